"""draftflow: lossless speculative decoding composed as a checked dataflow graph."""

__version__ = "0.1.0"
