"""docs/configuration.md is generated from the settings model and must be current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from magpie.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "scripts" / "gen_config_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_md_is_current():
    gen = _gen()
    assert gen.main(["--check"]) == 0, "docs/configuration.md is stale: run python scripts/gen_config_doc.py"


def test_every_setting_is_listed_with_a_description_and_no_secret_default():
    text = _gen().render()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")}
    names = {(f.alias or k).upper() for k, f in Settings.model_fields.items()}
    assert set(rows) == names
    assert all(not line.rstrip().endswith("| - |") for line in rows.values()), "a setting has no description"
    assert Settings.model_fields["encryption_key"].default not in text
    assert ">= 0.1, <= 2592000" in rows["MAGPIE_CHECK_INTERVAL"]


def test_a_stale_file_is_reported(tmp_path, monkeypatch, capsys):
    gen = _gen()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("MAGPIE_CHECK_INTERVAL", "MAGPIE_OLD_NAME"), encoding="utf-8")
    monkeypatch.setattr(gen, "OUT", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
