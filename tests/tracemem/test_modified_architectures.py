"""docs/modified-architectures.md runs as written: its example file is the one it quotes, its
CLI command prints the table it shows, its Python form gives the same figures.

References: the docs page itself (the printed table is the expected output); the parameter
difference against MLA by hand from DeepSeek-V3's config (h 7168, 128 heads of 128 value dims,
TP 2: 64 query heads and 4 of the example's 8 KV heads per rank; MLA's per-layer attention
at TP 2, 101,122,048, from docs/parallel.md's plan table: stage 0's 404,488,192 over 4 layers;
its q_norm 1536 and kv_norm 512).
"""

import re
from pathlib import Path

from modeling import load_config
from modeling.parallel.build import build_rank
from tracemem.cli import main
from tracemem.parallel import ParallelConfig
from tracemem.static import static_memory

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "modified-architectures.md").read_text()
EXAMPLE = ROOT / "docs" / "examples" / "window_attention.py"


def _blocks(language: str) -> list[str]:
    """The page's fenced blocks of ``language`` ("" for plain ones), in order."""
    blocks, current, lang = [], None, None
    for line in DOC.splitlines(keepends=True):
        fence = re.fullmatch(r"\s*```(\w*)\n?", line)
        if fence and current is None:
            current, lang = [], fence[1]
        elif fence:
            if lang == language:
                blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_docs_quote_the_example_file_whole():
    assert _blocks("python")[0] == EXAMPLE.read_text()


def test_the_docs_command_prints_the_docs_table(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' command runs from the repository root
    command, table = [b for b in _blocks("") if b.startswith("tracemem estimate")
                      or b.startswith("deepseek-v3:")][:2]
    args = command.replace("\\\n", " ").split()[1:]
    assert "--replace" in args and args[args.index("--replace") + 1].startswith("attn=")
    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().out == table


def test_the_python_form_gives_the_same_worst_rank(monkeypatch):
    monkeypatch.chdir(ROOT)
    code = _blocks("python")[1]
    scope: dict = {}
    exec(compile(code.replace("print(", "(lambda *a: None)("), "docs", "exec"), scope)
    result = scope["result"]
    assert result.worst.pp_stage == 1
    assert f"{result.worst.peak_bytes / 2**30:.2f}" == "93.29"  # the table's stage 1 peak
    assert result.settings["replace"] == {"attn": "WindowAttention"}


def test_the_example_adds_the_hand_counted_parameters_per_layer(monkeypatch):
    monkeypatch.chdir(ROOT)
    from modeling.common.custom import resolve_replacements

    v3 = load_config("deepseek-v3")
    par = ParallelConfig.create(v3, world_size=1024, tp=2, sp=True, pp=16, ep=8,
                                pp_first_stage_layers=4, pp_last_stage_layers=1)
    window = resolve_replacements(["attn=docs/examples/window_attention.py:WindowAttention"])
    mla = static_memory(build_rank(v3, par, 64), par).dense_params  # stage 1: layers 4-7
    mine = static_memory(build_rank(v3, par, 64, replace=window), par).dense_params
    qkv, out = (64 + 2 * 4) * 128 * 7168, 7168 * 64 * 128  # 66,060,288 and 58,720,256
    assert mine - mla == 4 * (qkv + out - 101_122_048 - 1536 - 512) == 94_625_792


def test_the_docs_inventory_rows_are_what_inventory_prints(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    command = next(b for b in _blocks("") if b.startswith("tracemem inventory"))
    rows = next(b for b in _blocks("") if b.startswith("deepseek-v3, layer 0"))
    args = [a.strip('"') for a in
            re.findall(r'"[^"]*"|\S+', command.replace("\\\n", " "))][1:]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(rows)
    # the attention's rows by hand: 58,720,256 + 75,497,472 + 67,108,864 + 1,048,576 +
    # 67,108,864 (1 x 4096 x 7168, 4096 x 9216, 1 x 64 x 4096 x 128 bf16; 1 x 64 x 4096 fp32)
    attention = [int(line.split()[4].replace(",", "")) for line in out.splitlines()
                 if line.startswith("layers.0.attn ")]
    assert sum(attention) == 269_484_032 == \
        2 * 4096 * (7168 + 9216 + 2 * 64 * 128) + 4 * 64 * 4096
