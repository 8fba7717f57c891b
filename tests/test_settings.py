"""Settings precedence, validation, and the documented example config."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve.server.settings import Settings, SettingsError, load_settings, parse_size

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("FLASHSERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(ROOT / "tests")  # no stray ./config.toml


def test_example_config_documents_every_key_with_its_default():
    text = (ROOT / "config.example.toml").read_text()
    documented = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, flags=re.M))
    assert documented == set(Settings.model_fields)
    assert load_settings(ROOT / "config.example.toml") == load_settings()


def test_precedence_file_then_env_then_cli(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('port = 7000\nhost = "127.0.0.2"\nmemory_budget = "3GB"\n')
    s = load_settings(cfg)
    assert (s.port, s.host, s.memory_budget) == (7000, "127.0.0.2", 3_000_000_000)
    monkeypatch.setenv("FLASHSERVE_PORT", "7100")
    assert load_settings(cfg).port == 7100
    assert load_settings(cfg, port=7200).port == 7200
    assert load_settings(cfg).host == "127.0.0.2"


def test_unknown_keys_and_bad_values_name_the_key(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text("bogus_key = 1\n")
    with pytest.raises(SettingsError, match="bogus_key"):
        load_settings(cfg)
    with pytest.raises(SettingsError, match="port"):
        load_settings(port="not-a-port")
    with pytest.raises(SettingsError, match="placement"):
        load_settings(placement="middle")
    monkeypatch.setenv("FLASHSERVE_PROT", "1")
    with pytest.raises(SettingsError, match="FLASHSERVE_PROT"):
        load_settings()


def test_sizes_and_lists():
    assert parse_size("300MB") == 300_000_000
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_size("lots")
    assert load_settings(allowed_origins="http://a, http://b").allowed_origins == [
        "http://a",
        "http://b",
    ]


def test_engine_config_takes_matching_fields():
    cfg = load_settings(resident_layers=3, placement="last_n").engine_config()
    assert (cfg.resident_layers, cfg.placement, cfg.residency) == (3, "last_n", "fixed")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["serve", "--model", "/no/such/model"], "no such file"),
        (["serve", "--model", "."], "not a model directory"),
        (["serve", "--port", "abc"], "port"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT / "tests",
    )
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_log_level_says_what_each_level_shows():
    """`--log-level` has help text, and its row on the settings page says more than
    its values (the page takes the field's description)."""
    import runpy

    proc = subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT / "tests",
    )
    assert proc.returncode == 0, proc.stderr
    words = " ".join(proc.stdout.split())
    after = words.rsplit("--log-level {debug,info,warning,error}", 1)[1].lstrip()
    assert not after.startswith("--"), after[:80]  # a help text before the next flag
    description = Settings.model_fields["log_level"].description
    assert description and " ".join(description.split()) in words
    render = runpy.run_path(str(ROOT / "docs_hooks" / "settings_reference.py"))["render_settings"]
    (row,) = [line for line in render().splitlines() if line.startswith("| `log_level` |")]
    values, meaning = (re.sub(r"[`\\| ]", "", cell) for cell in row.split(" | ")[2:4])
    assert meaning != values, row
