"""README.md stays a front door that works: short, its two commands are Makefile targets, and every file,
config and command it names exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def _bash_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_it_is_short() -> None:
    assert len(README.splitlines()) < 250


def test_the_two_commands_are_makefile_targets() -> None:
    first_block = _bash_lines()[:2]
    assert first_block == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no target {target}"


def test_every_linked_file_exists() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) > 10
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert missing == []


def test_every_config_it_names_exists() -> None:
    names = set(re.findall(r"configs/[\w.]+\.yaml", README))
    names |= {f"configs/{n}" for n in re.findall(r"`([\w.*]+\.yaml)`", README)}
    assert len(names) > 5
    missing = [n for n in names if not list(ROOT.glob(n))]
    assert missing == []


def test_its_commands_parse(capsys) -> None:
    """Each `python -m mas_async ...` line of the README is a command the CLI accepts (checked with
    --dry-run: the config loads and every process is placed, nothing starts)."""
    from mas_async.launch.cli import main

    commands = [line for line in _bash_lines() if line.startswith("python -m mas_async")]
    assert commands
    for line in commands:
        argv = shlex.split(line)[3:]
        assert main([*argv, "--dry-run"]) == 0, line
        assert "nothing started" in capsys.readouterr().out
