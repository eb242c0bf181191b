"""`bench.program` (compiled program size): its HLO counting on known text, and one small real compile of each
candidate. Sizes are checked only by structural facts that hold for optim and optax alike; times never."""

import pytest

from bench import program

# A hand-written module: a fused computation before ENTRY (its instructions must not count), tuple shapes with
# `/*index=5*/` comments (one nested), a multi-output fusion, metadata holding ` = ` and parentheses, a TPU-style
# layout with parentheses, and every trivial opcode.
HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[4]{0}, f32[4]{0})->(f32[4]{0}, f32[4]{0})}

%fused_computation (param_0: f32[4], param_1: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %param_1 = f32[4]{0} parameter(1)
  %copy.99 = f32[4]{0} copy(%param_0)
  ROOT %add.1 = f32[4]{0} add(%copy.99, %param_1)
}

%fused_pair (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0)
  %neg = f32[4]{0} negate(%p)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%neg, %p)
}

ENTRY %main.7 (x.1: f32[4], g.1: f32[4], s.1: s32[]) -> (f32[4], f32[4], f32[4], f32[4], f32[4], /*index=5*/f32[8]) {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %g.1 = f32[4]{0} parameter(1), metadata={op_name="g = y(z)"}
  %s.1 = s32[] parameter(2)
  %constant.3 = f32[] constant(0.5)
  %copy.1 = f32[4]{0} copy(%x.1)
  %add_fusion = f32[4]{0} fusion(%copy.1, %g.1), kind=kLoop, calls=%fused_computation
  %pair_fusion = (f32[4]{0}, f32[4]{0}) fusion(%g.1), kind=kLoop, calls=%fused_pair
  %get-tuple-element.1 = f32[4]{0} get-tuple-element(%pair_fusion), index=0
  %get-tuple-element.2 = f32[4]{0} get-tuple-element(%pair_fusion), index=1
  %bitcast.4 = f32[2,2]{1,0:T(2,2)} bitcast(%add_fusion)
  %concatenate.5 = f32[8]{0} concatenate(%x.1, %g.1), dimensions={0}
  %big = (f32[4]{0}, (f32[4]{0}, s32[]), /*index=5*/f32[4]{0}) custom-call(%x.1), custom_call_target="f"
  ROOT %tuple.6 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/f32[8]{0}) tuple(%add_fusion, \
%get-tuple-element.1, %get-tuple-element.2, %copy.1, %x.1, /*index=5*/%concatenate.5)
}
""".replace("\\\n", "")


def test_entry_counts_known_text():
    assert program.entry_counts(HLO) == {"inputs": 3, "fusions": 2, "copies": 1, "other": 2, "instructions": 13}


def test_entry_counts_needs_an_entry():
    with pytest.raises(ValueError):
        program.entry_counts(HLO.replace("ENTRY ", ""))


@pytest.mark.parametrize("candidate", program.CANDIDATES)
def test_measure_two_leaves(candidate):
    """A 2-leaf model of two shapes: Adam reads parameter, gradient, m and v of every leaf, and writes each
    leaf's new parameter with at least one kernel (a fusion)."""
    import jax.numpy as jnp

    model = {"a": jnp.full((16, 16), 0.5), "b": jnp.full((8,), 0.25)}
    grads = {"a": jnp.full((16, 16), 1e-3), "b": jnp.full((8,), 2e-3)}
    row = program.measure(candidate, model, grads)
    assert row["candidate"] == candidate and row["leaves"] == 2
    assert row["inputs"] >= 2 * 4
    assert row["fusions"] >= 2
    assert row["fusions_per_leaf"] == row["fusions"] / 2 and row["copies_per_leaf"] == row["copies"] / 2
    assert row["instructions"] >= row["inputs"] + row["fusions"] + row["copies"] + row["other"]
    assert row["compile_s"] > 0
    text = program.render([{"workload": "2 leaves", **row}], {
        "date": "today", "optim": "abc", "jax": "1", "jaxlib": "1", "optax": "1", "backend": "cpu",
        "loadavg": [0.0, 0.0]})
    assert f"| 2 leaves | {candidate} | 2 | {row['inputs']} | {row['fusions']} |" in text
