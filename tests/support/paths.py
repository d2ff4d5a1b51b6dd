"""Where the checkout is (configs, data) for every test."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
