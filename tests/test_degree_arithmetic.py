"""Only harness.parallel_dims multiplies or divides parallel degrees, so that a new axis changes the
world size, the derived dp and the rank placement in one place; its callers keep their verdicts."""

from __future__ import annotations

import ast
import pathlib

import pytest

from harness.errors import SpecError
from harness.parallel_dims import ParallelDims

ROOT = pathlib.Path(__file__).resolve().parent.parent / "harness"
DEGREES = {"tp", "pp", "dp", "cp"}
WORLDS = {"world", "world_size", "gpus", "nproc"}


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _of_degrees(node) -> bool:
    """A degree, a world size, or a product or quotient of them only."""
    if isinstance(node, ast.BinOp):
        return _of_degrees(node.left) and _of_degrees(node.right)
    if isinstance(node, ast.UnaryOp):
        return _of_degrees(node.operand)
    return _name(node) in DEGREES | WORLDS


def degree_arithmetic(source: str, where: str = "") -> list[str]:
    """Each `a op b` with op one of * / // % whose two sides are both degrees or world sizes
    (tp * pp, gpus // (tp * pp), world % dp); a tensor dimension over its degree (vocab / tp) passes."""
    ops = (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
    return [
        f"{where}:{n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.BinOp) and isinstance(n.op, ops) and _of_degrees(n.left) and _of_degrees(n.right)
    ]


def test_no_code_outside_the_owner_multiplies_or_divides_degrees():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if path.name != "parallel_dims.py":
            found += degree_arithmetic(path.read_text(), where)
    assert not found, "degree arithmetic outside harness/parallel_dims.py:\n" + "\n".join(found)


def test_the_guard_sees_degree_products_and_lets_sharding_math_pass():
    probe = "a = lay.tp * lay.pp\nb = gpus // (tp * pp)\nc = vocab // lay.tp\nd = batch // (dp * mb)\ne = -tp * dp\n"
    assert sorted(h.split(": ", 1)[1] for h in degree_arithmetic(probe)) == [
        "-tp * dp",
        "gpus // (tp * pp)",
        "lay.tp * lay.pp",
        "tp * pp",
    ]


def test_the_study_csvs_world_size_must_divide_by_its_model_parallel_degrees(tmp_path):
    from harness.planner.paper import load_sweep

    header = (
        "Trial ID,World Size,Average Step Time,Average MFU,activation_checkpointing_type,kernel,"
        "micro_batch_size,model_parallel_size,pipe_parallel_size\n"
    )
    path = tmp_path / "llama_13B_seq2048.csv"
    path.write_text(header + "1,32,1.0,0.5,disabled,flash_attention2,1,4,2\n")
    assert load_sweep(path)[0].layout.dp == 4
    path.write_text(header + "2,30,1.0,0.5,disabled,flash_attention2,1,4,2\n")  # was read as dp 3 (24 GPUs)
    with pytest.raises(SpecError) as e:
        load_sweep(path)
    assert e.value.field == "--calibrate-csv" and "row 2: World Size: world size 30 is not divisible" in e.value.reason


def test_synthetic_records_hold_as_many_ranks_as_their_sweep_has_gpus():
    from harness.testing.synthetic import make_records

    for r in make_records(100, seed=1):
        assert ParallelDims.of(r["spec"]["layout"]).world == r["fingerprint"]["world_size"]
