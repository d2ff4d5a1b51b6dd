"""Which code a run ran: the git commit of the checkout `mas_async` is imported from, recorded in
RUN_DIR/commit.txt when the run starts (a line more when it resumes), and copied by `mas-async results`
beside the run's figures, so a committed figure names the code that made it.

A line is the commit's 40 hex digits, followed by " with uncommitted changes" when tracked files differed
from it; "unknown: <why>" where there is no git checkout (an installed package) or no git.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import mas_async

COMMIT_FILE = "commit.txt"
CHECKOUT = Path(mas_async.__file__).resolve().parents[1]
"""Where the code runs from: the repository root in a checkout."""
GIT_TIMEOUT_S = 10.0


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
    )


def code_commit() -> str:
    """The running code's commit, as one line of COMMIT_FILE (see the module docstring)."""
    try:
        head = _git("rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return "unknown: the code is not in a git checkout"
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown: git did not answer ({type(e).__name__})"
    commit = head.stdout.strip()
    return f"{commit} with uncommitted changes" if changed.returncode == 0 and changed.stdout.strip() else commit


def record_commit(run_dir: Path, resumed_at: int | None = None) -> None:
    """Write the running code's commit to `run_dir`/COMMIT_FILE; a resumed run adds a line for its start."""
    path = Path(run_dir) / COMMIT_FILE
    if resumed_at is None or not path.is_file():
        path.write_text(code_commit() + "\n")
    else:
        with path.open("a") as file:
            file.write(f"resumed at version {resumed_at}: {code_commit()}\n")
