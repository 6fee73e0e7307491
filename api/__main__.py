from draftflow.core.cli import console

console()
