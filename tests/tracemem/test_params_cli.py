"""``tracemem params``: the activated count with and without the input embedding. Reference:
Mixtral-8x7B's config.json (vocab 32,000, h 4,096) and Mistral's published "12.9B active"
(which counts the embedding); the count without it is derived by hand in
tests/modeling/test_moe_family_params.py."""

from __future__ import annotations

import json

from tracemem.cli import main


def test_params_shows_activated_with_and_without_the_embedding(capsys):
    assert main(["params", "--model", "mixtral-8x7b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    embedding = 32_000 * 4_096
    assert data["by_component"]["embedding"] == embedding == 131_072_000
    assert data["activated_per_token"] == 12_748_853_248
    assert data["activated_per_token_with_embedding"] == 12_748_853_248 + 131_072_000 \
        == 12_879_925_248  # Mistral's "12.9B"
    assert main(["params", "--model", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "activated + input embedding       12,879,925,248" in out
    assert "include it (the last row)" in out
