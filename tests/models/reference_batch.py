"""Runs several commands of a reference script in one Python process, so that torch and
transformers are imported once instead of once per command (each import costs seconds; the parity
tests run dozens of commands).

  SCRIPT batch LIST
      LIST holds one command per line, written as the script's own arguments (shell-quoted). The
      output of line i (0-based) goes to LIST.i.log and its exit status to LIST.i.rc; a command
      that raises is status 1 with its traceback in its log. The batch itself exits 0.

tests/models/batched_steps.sh queues the commands and turns each result into one test case.
"""
import contextlib
import shlex
import sys
import traceback


def run(list_path, dispatch):
    """dispatch(argv) runs one command; its SystemExit code (or 0) is the command's status."""
    with open(list_path) as f:
        commands = [shlex.split(line) for line in f if line.strip()]
    for i, argv in enumerate(commands):
        with open(f"{list_path}.{i}.log", "w") as log:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                try:
                    dispatch(argv)
                    rc = 0
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except Exception:  # one command's failure must not hide the others' results
                    traceback.print_exc()
                    rc = 1
        with open(f"{list_path}.{i}.rc", "w") as f:
            f.write(f"{rc}\n")
        sys.stdout.flush()
