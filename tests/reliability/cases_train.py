"""Bad flags and paths for `draftflow train`: most are refused before torch or the target loads."""

from pathlib import Path

from harness import Case, copy_demo

TEXT = "def add(x, y):\n    \"\"\"Add two numbers.\"\"\"\n    return x + y\n\n" * 60
FAST = ["--data", "data.py", "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "1",
        "--eval-every", "0", "--save-every", "0", "--device", "cpu"]
BLOCK = ["--layers", "1", "--block-size", "4", "--anchors", "2"]


def train(recipe: str, *extra: str, out: str = "out", target: str = "target") -> list[str]:
    return ["train", recipe, "--target", target, "--out", out, *FAST, *(BLOCK if recipe != "mtp" else ()), *extra]


def demo(*names: str, into: dict | None = None):
    """setup: writable copies of demo model folders (`target`, `dflash`, ...), optionally under other names."""
    def setup(tmp: Path) -> None:
        for name in names:
            copy_demo(tmp, name)
        for name, dest in (into or {}).items():
            (tmp / name).rename(tmp / dest)
    return setup


def _drafter_written(folder: str, kept: str | None = None):
    def check(r, tmp: Path) -> None:
        out = tmp / folder
        assert (out / "config.json").exists(), sorted(p.name for p in out.iterdir())
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name], "a temporary file was left behind"
        if kept:
            assert (out / kept).read_text() == "mine\n", f"{kept} was touched"
    return check


DATA = {"data.py": TEXT}
T = demo("target")

CASES = [
    # the data loss of the issue: --out is the target (exit 0 and the target's weights replaced, before)
    Case("train-out-is-target", train("dflash", out="target"), r"--out target: is the --target folder target; .*pick "
         r"a new folder, e\.g\. target-dflash", files=DATA, setup=T),
    Case("train-out-inside-target", train("mtp", out="target/mtp"), r"--out target/mtp: is inside the --target folder",
         files=DATA, setup=T),
    Case("train-out-is-target-through-a-link", train("dflash", out="link"), r"--out link: is the --target folder",
         files=DATA, setup=lambda tmp: (copy_demo(tmp, "target"), (tmp / "link").symlink_to(tmp / "target"))),
    Case("train-out-is-init-from", train("dflash2", "--init-from", "dflash", out="dflash"),
         r"--out dflash: is the --init-from folder dflash", files=DATA, setup=demo("target", "dflash")),
    Case("train-out-is-data-folder", train("dflash", "--data", "texts", out="texts"),
         r"--out texts: is the --data folder texts", files={"texts/a.py": TEXT}, setup=T),
    Case("train-out-is-a-file", train("dflash", out="data.py"), r"--out data\.py: is a file; give a folder",
         files=DATA, setup=T),
    Case("train-out-foreign-folder", train("dflash", out="mine"), r"--out mine: holds files a `train dflash` run does "
         r"not write \(notes\.txt\); pick a new or empty folder, or pass --overwrite", files={**DATA, "mine/notes.txt": "mine\n"},
         setup=T),
    Case("train-out-holds-another-recipe", train("dflash", out="mtp"), r"--out mtp: holds MTP heads .*, not a dflash "
         r"drafter; .*--overwrite", files=DATA, setup=demo("target", "mtp")),
    Case("train-summary-over-data-file", train("mtp", "--summary", "data.py"),
         r"--summary data\.py: data\.py is a --data file the run reads", files=DATA, setup=T),
    Case("train-gguf-into-target", train("dflash", "--gguf", "target/drafter.gguf"),
         r"--gguf target/drafter\.gguf: target/drafter\.gguf lies in the --target folder target", files=DATA, setup=T),
    Case("train-checkpoint-is-out-config", train("mtp", "--checkpoint", "out/config.json"),
         r"--checkpoint out/config\.json: out/config\.json is also the --out output", files=DATA, setup=T),
    Case("train-summary-missing-folder", train("mtp", "--summary", "nodir/s.json"),
         r"--summary nodir/s\.json: the folder nodir does not exist", files=DATA, setup=T),
    # what --out may be: an earlier output of the same recipe, or anything with --overwrite (other files kept)
    Case("train-rerun-into-previous-output", train("mtp", out="mtp"), r"wrote mtp: step 1", exit=0, files=DATA,
         setup=demo("target", "mtp"), outputs=["mtp/config.json", "mtp/mtp.safetensors", "mtp/checkpoint.pt"],
         check=_drafter_written("mtp")),
    Case("train-overwrite-keeps-other-files", train("dflash", "--overwrite", out="mine"), r"wrote mine: step 1",
         exit=0, files={**DATA, "mine/notes.txt": "mine\n"}, setup=T, check=_drafter_written("mine", "notes.txt")),
    # numbers refused at parse time (tracebacks, hangs or silent defaults before)
    Case("train-steps-zero", train("dflash", "--steps", "0"), r"--steps 0: must be at least 1 \(optimizer steps\)"),
    Case("train-steps-negative", train("mtp", "--steps", "-5"), r"--steps -5: must be at least 1"),
    Case("train-batch-size-zero", train("dflash", "--batch-size", "0"), r"--batch-size 0: must be at least 1"),
    Case("train-batch-size-huge", train("mtp", "--batch-size", "100000000"),
         r"--batch-size 100000000 x --seq-len 32 is 3200000000 tokens, more than 16777216 at once", timeout=30),
    Case("train-eval-decode-tokens-negative", train("dflash", "--eval-decode-tokens", "-1"),
         r"--eval-decode-tokens -1: must be at least 0 \(tokens decoded per held-out window; 0: off\)"),
    Case("train-lr-zero", train("dflash", "--lr", "0"), r"--lr 0\.0: must be above 0\.0 \(the peak learning rate"),
    Case("train-lr-nan", train("dflash", "--lr", "nan"), r"--lr nan: not a finite number"),
    Case("train-warmup-above-one", train("mtp", "--warmup", "1.5"), r"--warmup 1\.5: must be at most 1\.0"),
    Case("train-time-budget-negative", train("mtp", "--time-budget-min", "-1"), r"--time-budget-min -1\.0: must be "
         r"above 0\.0"),
    Case("train-block-size-one", train("dflash", "--block-size", "1"), r"--block-size 1: must be at least 2"),
    Case("train-block-size-zero", train("dflash", "--block-size", "0"), r"--block-size 0: must be at least 2"),
    Case("train-layers-zero", train("dflash", "--layers", "0"), r"--layers 0: must be at least 1"),
    Case("train-seed-huge", train("mtp", "--seed", "100000000000000000000000"), r"--seed 1+0+: must be at most"),
    Case("train-steps-not-a-number", train("mtp", "--steps", "many"), r"argument --steps: invalid int value", exit=2),
    # options that do not apply are refused, not ignored
    Case("train-option-of-another-recipe", train("mtp", "--block-size", "4"),
         r"--block-size is an option of dflash and dflash2, not of mtp; drop it"),
    Case("train-dflash2-option-for-dflash", train("dflash", "--selector-top-k", "8"),
         r"--selector-top-k is an option of dflash2, not of dflash"),
    Case("train-mtp-layout-for-dflash", train("dflash", "--mtp-layout", "qwen3-next"),
         r"--mtp-layout is an option of mtp, not of dflash; drop it"),
    Case("train-mtp-layout-unknown", train("mtp", "--mtp-layout", "medusa"),
         r"argument --mtp-layout: invalid choice: 'medusa'", exit=2),
    Case("train-prompt-len-without-regenerate", train("dflash", "--prompt-len", "8"),
         r"--prompt-len applies to --labels regenerate only"),
    # inputs that are not what they should be
    Case("train-target-missing", train("dflash", target="nope"), r"--target nope: no such model folder or file"),
    Case("train-target-is-text", train("dflash", target="data.py"), r"--target data\.py: a file that is not \.gguf; "
         r"pass the frozen target model", files=DATA),
    Case("train-target-is-a-drafter", train("dflash", target="{demo}/dflash"), r"--target .*dflash: a DFlash drafter; "
         r"pass the frozen target model"),
    Case("train-init-from-mtp-heads", train("dflash2", "--init-from", "{demo}/mtp"),
         r"--init-from .*mtp: MTP heads \(mtp\.safetensors\); --init-from takes a DFlash or DFlash2 drafter",
         files=DATA, setup=T),
    Case("train-dflash-init-from-a-dflash2", train("dflash", "--init-from", "{demo}/dflash2"),
         r"--init-from .*dflash2: a DFlash2 drafter; --init-from takes a DFlash \(v1\) drafter", files=DATA, setup=T),
    Case("train-dflash2-init-from-dflash2-other-selector", train("dflash2", "--init-from", "{demo}/dflash2",
                                                                 "--selector-rank", "32"),
         r"--init-from .*dflash2 fixes the DFlash2 drafter's shape, but .*--selector-rank 32 \(it has \d+\)", files=DATA,
         setup=T),
    Case("train-data-missing", train("mtp", "--data", "nope.txt"), r"--data nope\.txt: no such file or folder", setup=T),
    Case("train-data-binary", train("mtp", "--data", "blob.txt"), r"--data blob\.txt: not UTF-8 text",
         files={"blob.txt": bytes(range(256)) * 8}, setup=T),
    Case("train-data-empty-file", train("mtp", "--data", "empty.txt"), r"--data empty\.txt: the file is empty",
         files={"empty.txt": ""}, setup=T),
    Case("train-data-folder-without-text", train("mtp", "--data", "imgs"), r"--data imgs: no \.py, \.txt or \.md files",
         files={"imgs/a.png": b"\x89PNG"}, setup=T),
    Case("train-data-flag-without-paths", ["train", "mtp", "--target", "target", "--out", "out", "--data"],
         r"--data needs at least one file or folder", setup=T),
    Case("train-device-unknown", train("mtp", "--device", "banana"), r"--device banana: not a device", files=DATA,
         setup=T),
    Case("train-device-missing-cuda", train("mtp", "--device", "cuda:99"),
         r"--device cuda:99: device 'cuda:99' (needs CUDA, but this torch build|does not exist|.*sees no CUDA device)", files=DATA,
         setup=T),
    # checked once the target is loaded (its context, the block width, the text it tokenizes)
    Case("train-seq-len-past-context", train("mtp", "--seq-len", "600"),
         r"--seq-len 600: longer than the target's context of 512 tokens", files=DATA, setup=T),
    Case("train-seq-len-below-block", train("dflash", "--seq-len", "4"),
         r"--seq-len 4 leaves no room for a block of 4 after the first token; use --seq-len of at least 5", files=DATA,
         setup=T),
    Case("train-data-shorter-than-a-window", train("mtp", "--data", "tiny.py", "--seq-len", "256"),
         r"the training text has \d+ tokens, not more than one window of --seq-len 256", files={"tiny.py": "x = 1\n"},
         setup=T),
    Case("train-resume-from-a-non-checkpoint", train("mtp", "--resume", "--checkpoint", "state.pt"),
         r"--checkpoint state\.pt: not a readable training checkpoint", files={**DATA, "state.pt": "not a checkpoint\n"},
         setup=T),
]
