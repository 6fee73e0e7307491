"""draftflow-bigram: an example third-party draftflow plugin (see README.md)."""
