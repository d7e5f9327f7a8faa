"""twinspark.ops.plans: the override parser (keys, values, errors), the tables' defaults, and that the launch plans
made from the tables are the ones the ops made before the tunables became data (environment switches then: the same
plans, switch for key). CPU only: the plan functions read shapes and the table, never a device."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from twinspark.ops import plans, sms
from twinspark.ops.exl3_gemm import FUSED_BLOCKS
from twinspark.ops.exl3_gemm import plan as gemm_plan
from twinspark.ops.exl3_moe import gate_up_pdl, plan_launch

REPO = Path(__file__).resolve().parents[1]
# The last commit whose ops read the environment switches (TWINSPARK_EXL3_GEMM_*, TWINSPARK_EXL3_MOE_*).
BEFORE = "af2386a03053a443cc993d0deb87c881f761a546"


# ------------------------------------------------------------------------------------------------- parser
def test_parse_good_keys():
    p = plans.parse(" exl3_moe.split_k=3m, exl3_gemm.variant=small ,exl3_gemm.sk_blocks=0,exl3_moe.pdl=1,"
                    "exl3_moe.gate_up4=any,exl3_gemm.blocks_per_sm=4,exl3_gemm.fused_efficiency=2:1.2,"
                    "exl3_moe.smem_per_sm=102400,exl3_moe.bytesum=0")
    g, m = p.exl3_gemm, p.exl3_moe
    assert (g.variant, g.sk_blocks, g.prep, g.block) == ("small", 0, None, None)
    assert dict(g.blocks_per_sm) == {1: 4.0, 2: 4.0, 4: 4.0, 8: 4.0}
    assert dict(g.fused_efficiency) == {0: 1.0, 2: 1.2}
    assert (m.split_k, m.pdl, m.gate_up4, m.smem_per_sm, m.bytesum, m.early_down) == ("3m", True, "any", 102400,
                                                                                      False, None)
    assert plans.DEFAULT.exl3_moe.split_k is None  # the default table is not touched
    # a later item wins; auto gives a forcing key back to the table; an empty spec is the base
    assert plans.parse("exl3_moe.pdl=1,exl3_moe.pdl=0").exl3_moe.pdl is False
    assert plans.parse("exl3_moe.pdl=auto", p).exl3_moe.pdl is None
    assert plans.parse("", p) == p and plans.parse(" , ") == plans.DEFAULT
    assert plans.changes(plans.parse("exl3_moe.split_k=2,exl3_gemm.prep=0")) == "exl3_gemm.prep=0,exl3_moe.split_k=2"
    assert plans.changes(plans.DEFAULT) == ""
    spec = plans.changes(p)  # round trip
    assert plans.parse(spec) == p
    for key, row in plans.keys().items():  # every key: its default parses back to itself
        op, name = key.split(".")
        assert plans.parse(f"{key}={row['default']}") == plans.DEFAULT, key
        assert row["why"] and row["accepts"]


@pytest.mark.parametrize(("spec", "message"), [
    ("exl3_moe.splitk=3", r"^TWINSPARK_PLAN: unknown key 'exl3_moe.splitk' \(did you mean exl3_moe.split_k\?\); the "
                          r"keys are exl3_gemm.variant, .*exl3_moe.smem_per_sm.* \(twinspark.ops.plans.keys\(\)"),
    ("nothing=1", r"^TWINSPARK_PLAN: unknown key 'nothing'; the keys are "),
    ("exl3_moe.pdl", r"^TWINSPARK_PLAN: 'exl3_moe.pdl' is not an op.key=value item"),
    ("=1", r"is not an op.key=value item"),
    ("exl3_moe.split_k=two", r"^TWINSPARK_PLAN: exl3_moe.split_k='two' is not accepted; exl3_moe.split_k takes auto, "
                             r"N or Nm \(N >= 1\) \(default auto\)$"),
    ("exl3_moe.split_k=0", r"exl3_moe.split_k='0' is not accepted"),
    ("exl3_moe.pdl=yes", r"exl3_moe.pdl='yes' is not accepted; exl3_moe.pdl takes auto, 0 or 1 \(default auto\)$"),
    ("exl3_moe.bytesum=auto", r"exl3_moe.bytesum='auto' is not accepted; exl3_moe.bytesum takes 0 or 1 \(default 1\)"),
    ("exl3_moe.down_blocks=5", r"takes auto, 2, 3 or 4"),
    ("exl3_moe.gate_up4=1", r"exl3_moe.gate_up4 takes auto, 0 or any"),
    ("exl3_moe.smem_per_sm=4096", r"takes 0 or a byte count from 102400 to 233472 \(default 0\)"),
    ("exl3_moe.smem_per_sm=100KB", r"exl3_moe.smem_per_sm='100KB' is not accepted"),
    ("exl3_gemm.variant=tiny", r"exl3_gemm.variant takes auto, small, fused, fused_mma or large"),
    ("exl3_gemm.block=1", r"exl3_gemm.block takes auto, 0 or 2"),
    ("exl3_gemm.sk_blocks=-1", r"exl3_gemm.sk_blocks='-1' is not accepted"),
    ("exl3_gemm.large_m=0", r"exl3_gemm.large_m takes a token count >= 1 \(default 64\)"),
    ("exl3_gemm.blocks_per_sm=3:2", r"blocks_per_sm='3:2' is not accepted.*over groups 1, 2, 4, 8 \(default "
                                    r"1:6/2:3/4:3/8:2\)"),
    ("exl3_gemm.blocks_per_sm=nan", r"blocks_per_sm='nan' is not accepted"),
    ("exl3_gemm.sk_max_fill=inf", r"sk_max_fill='inf' is not accepted"),
])
def test_parse_refuses_in_one_sentence(spec, message):
    with pytest.raises(plans.PlanError, match=message) as e:
        plans.parse(spec)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_environment_is_read_once_and_override_nests():
    """$TWINSPARK_PLAN is parsed on the first use in a process (a bad one fails there, naming the variable); the
    in-process override layers on the current plans and is undone on exit, exceptions included."""
    code = ("from twinspark.ops import plans; import os; p = plans.current(); os.environ['TWINSPARK_PLAN'] = "
            "'exl3_moe.pdl=0'; assert plans.current() is p; print(plans.changes())")
    env = dict(os.environ, TWINSPARK_PLAN="exl3_moe.split_k=3,exl3_gemm.prep=1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "exl3_gemm.prep=1,exl3_moe.split_k=3", out.stderr
    env["TWINSPARK_PLAN"] = "exl3_moe.split_k=x"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TWINSPARK_PLAN: exl3_moe.split_k='x' is not accepted" in out.stderr
    assert plans.from_env({"TWINSPARK_PLAN": "exl3_gemm.block=2"}).exl3_gemm.block == 2
    assert plans.from_env({}) == plans.DEFAULT

    base = plans.current()
    with plans.override("exl3_moe.pdl=1") as outer:
        assert plans.current() is outer and outer.exl3_moe.pdl is True
        with plans.override("exl3_gemm.variant=large"):
            assert (plans.current().exl3_moe.pdl, plans.current().exl3_gemm.variant) == (True, "large")
        with plans.override("exl3_gemm.variant=large", base=plans.DEFAULT):
            assert plans.current().exl3_moe.pdl is None
        with pytest.raises(plans.PlanError, match="^plan override: unknown key 'pdl'"):
            with plans.override("pdl=1"):
                pass
        assert plans.current() is outer
    with pytest.raises(RuntimeError), plans.override("exl3_moe.pdl=0"):
        raise RuntimeError
    assert plans.current() is base
    with plans.override("exl3_moe.pdl=0") as inner:  # use(): for the rest of the run (here: of the override)
        assert plans.use("exl3_moe.split_k=2") is inner
        assert (plans.current().exl3_moe.split_k, plans.current().exl3_moe.pdl) == ("2", False)
    assert plans.current() is base


def test_sm_count_override(monkeypatch):
    """Plans sized for a green context's SMs: sms.limit() inside, TWINSPARK_SM_COUNT (read once per process) outside,
    the device's else."""
    monkeypatch.setattr(sms, "device_sms", lambda index: 132)
    monkeypatch.setattr(sms, "_env_sms", lambda: None)
    assert sms.sm_count(0) == 132
    monkeypatch.setattr(sms, "_env_sms", lambda: 64)
    assert sms.sm_count(0) == 64
    with sms.limit(48):
        assert sms.sm_count(0) == 48
        with sms.limit(8):
            assert sms.sm_count(0) == 8
        assert sms.sm_count(0) == 48
    assert sms.sm_count(0) == 64
    assert sms.from_env({sms.ENV: " 64 "}) == 64 and sms.from_env({}) is None
    with pytest.raises(ValueError, match="TWINSPARK_SM_COUNT must be a number of SMs from 1 to 1024, got 'lots'"):
        sms.from_env({sms.ENV: "lots"})
    with pytest.raises(ValueError, match="number of SMs"):
        with sms.limit(0):
            pass
    assert gemm_plan(1, 5120, 1152, 5, 48).splits < gemm_plan(1, 5120, 1152, 5, 132).splits


# ------------------------------------------------------------------------------------------------ defaults
def test_default_tables_hold_what_the_ops_used():
    """The values the ops had as constants and as the defaults of their environment switches."""
    g, m = plans.DEFAULT.exl3_gemm, plans.DEFAULT.exl3_moe
    assert (g.variant, g.prep, g.block, g.sk_blocks) == (None, None, None, None)
    assert (g.large_m, g.fused_max_m, g.no_wgmma_small_max_m, g.no_wgmma_small_min_weights) == (64, 512, 256, 1 << 24)
    assert (g.fused_min_sms, g.no_wgmma_mma_max_m, g.mma_tokens) == (64, 256, None)
    assert dict(g.blocks_per_sm) == {1: 6.0, 2: 3.0, 4: 3.0, 8: 2.0}
    assert (g.prep_groups, g.prep_work) == (4, 98304)
    assert dict(g.fused_efficiency) == {0: 1.0, 2: 1.08}
    assert (g.sk_min_tiles, g.sk_max_fill, g.sk_min_tile_chunks, g.sk_min_chunks) == (0.5, 0.85, 32, 4)
    assert set(g.fused_efficiency) == set(FUSED_BLOCKS)
    assert (m.split_k, m.down_blocks, m.early_down, m.pdl) == (None, None, None, None)
    assert (m.bytesum, m.rate_kernels, m.packed, m.fit_smem, m.smem_per_sm) == (True, True, True, True, 0)
    assert (m.gate_up4, m.down4, m.gate_up4_min_a_kb, m.down4_min_a_kb) == ("auto", "auto", 5, 7)
    assert plans.SMEM_PER_SM_RANGE == (100 * 1024, 228 * 1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.large_m = 1
    with pytest.raises(TypeError):
        g.blocks_per_sm[1] = 1.0


# The cases compared: (plan key spec, the environment switches that meant the same before) x a grid of shapes.
GEMM_FORCED = [("", {}), ("exl3_gemm.variant=small", {"VARIANT": "small"}),
               ("exl3_gemm.variant=large", {"VARIANT": "large"}), ("exl3_gemm.prep=0", {"PREP": "0"}),
               ("exl3_gemm.prep=1", {"PREP": "1"}), ("exl3_gemm.block=0", {"BLOCK": "0"}),
               ("exl3_gemm.block=2", {"BLOCK": "2"}), ("exl3_gemm.sk_blocks=0", {"SK_BLOCKS": "0"}),
               ("exl3_gemm.sk_blocks=7", {"SK_BLOCKS": "7"}),
               ("exl3_gemm.block=0,exl3_gemm.sk_blocks=100000", {"BLOCK": "0", "SK_BLOCKS": "100000"}),
               ("exl3_gemm.blocks_per_sm=4", {"BLOCKS_PER_SM": 4.0})]
GEMM_MS = (1, 2, 7, 8, 9, 16, 17, 33, 63, 64, 65, 128, 129, 255, 256, 257, 300, 511, 512, 513, 1024, 4096)
GEMM_SHAPES = ((1152, 5120), (5120, 1152), (4096, 5120), (5120, 4096), (5120, 12288), (128, 128), (384, 1280),
               (6144, 128), (4096, 1024), (7168, 2048))
MOE_FORCED = [("", {}), ("exl3_moe.split_k=1", {"SPLITK": "1"}), ("exl3_moe.split_k=3", {"SPLITK": "3"}),
              ("exl3_moe.split_k=2m", {"SPLITK": "2m"}), ("exl3_moe.split_k=40", {"SPLITK": "40"}),
              ("exl3_moe.down_blocks=2", {"DOWN_BLOCKS": "2"}), ("exl3_moe.down_blocks=4", {"DOWN_BLOCKS": "4"}),
              ("exl3_moe.early_down=0", {"EARLY_DOWN": "0"}), ("exl3_moe.early_down=1", {"EARLY_DOWN": "1"}),
              ("exl3_moe.bytesum=0", {"BYTESUM": "0"}), ("exl3_moe.fit_smem=0", {"FIT_SMEM": "0"}),
              ("exl3_moe.smem_per_sm=102400", {"SMEM_PER_SM": "102400"}), ("exl3_moe.pdl=0", {"PDL": "0"}),
              ("exl3_moe.pdl=1", {"PDL": "1"})]
MOE_GRID = [(T, top_k, E, hidden, inter, sms_, gub, down4)
            for T in (1, 2, 3, 4, 8, 10, 11, 17, 64, 65, 512, 2048)
            for top_k in (1, 6, 8) for E in (1, 16, 384) for hidden, inter in ((5120, 1152), (1024, 512), (4096, 1536))
            for sms_ in (48, 132) for gub in (3, 4) for down4 in (False, True)]


def _new(spec: str, switches: dict):
    return plans.override(spec, base=plans.DEFAULT)


def _new_gemm(spec: str, switches: dict):
    # fused_min_sms and no_wgmma_mma_max_m (issue 43) came after BEFORE: at 1 every SM count may take the fused
    # kernel, at 0 no m takes fused_mma, as then
    return plans.override(",".join(filter(None, ("exl3_gemm.fused_min_sms=1,exl3_gemm.no_wgmma_mma_max_m=0", spec))),
                          base=plans.DEFAULT)


def _gemm_records(plan, forced=None) -> list:
    """(spec, m, k, n, sms, fused, Plan) over the grid; forced(spec, switches): the context each case set runs in."""
    out = []
    for spec, switches in GEMM_FORCED:
        with (forced or _new_gemm)(spec, switches):
            out += [(spec, m, k, n, s, fused, dataclasses.astuple(plan(m, k, n, 3, s, None, fused))) for m in GEMM_MS
                    for k, n in GEMM_SHAPES for s in (48, 132) for fused in (False, True)]
    return out


# The entries plan_launch's dict had at BEFORE (entries added since are new choices, not the ones compared).
MOE_KEYS = ("mt", "splitk", "short_groups", "max_items", "fuse_convert", "small_route", "down_min_blocks",
            "gate_up_blocks", "bytesum", "early_down", "smem_per_sm", "fit_smem")


def _moe_records(plan_launch, gate_up_pdl, forced=None) -> list:
    """(spec, case, plan_launch's MOE_KEYS) over the grid, and gate_up_pdl under and outside capture per spec."""
    out = []
    for spec, switches in MOE_FORCED:
        with (forced or _new)(spec, switches):
            for case in MOE_GRID:
                d = plan_launch(*case[:6], gate_up_blocks=case[6], down4=case[7])
                out.append((spec, case, {k: d[k] for k in MOE_KEYS}))
            out.append((spec, "pdl", gate_up_pdl(True), gate_up_pdl(False)))
    return out


def _digest(records) -> str:
    rows = [tuple(sorted(v.items()) if isinstance(v, dict) else v for v in r) for r in records]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


# sha256 (16 hex digits) of the records above as the ops made them at BEFORE, with the environment switches (the
# test below recomputes them from that source where git has the commit). A deliberate change of one of these plans
# fails both tests: move BEFORE to the commit that makes it and update the digests, saying which cases change.
GEMM_DIGEST = "96a07420da484e63"
MOE_DIGEST = "fc41441fdc5f58e2"


def test_plans_from_the_tables_match_the_digests():
    """Every plan of the grid, defaults and each forcing key, is what the ops made before (digests of those)."""
    assert _digest(_gemm_records(gemm_plan)) == GEMM_DIGEST
    assert _digest(_moe_records(plan_launch, gate_up_pdl)) == MOE_DIGEST


def _old_module(path: str) -> types.ModuleType:
    """The module at BEFORE up to its torch ops (their registration would clash with today's): the plan functions."""
    try:
        src = subprocess.run(["git", "show", f"{BEFORE}:{path}"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"git cannot show {path} at {BEFORE[:7]} here ({type(e).__name__}; a shallow clone?): the digest "
                    "test checks the same plans")
    mod = types.ModuleType(f"twinspark_before_{Path(path).stem}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up while the class is made
    try:
        exec(compile(src[:src.index("@torch.library.custom_op")], path, "exec"), mod.__dict__)  # noqa: S102
    finally:
        del sys.modules[mod.__name__]
    return mod


def _old_switches(prefix: str, mod):
    @contextlib.contextmanager
    def forced(spec: str, switches: dict):
        bps = getattr(mod, "BLOCKS_PER_SM", None)
        try:
            for k, v in switches.items():
                if k == "BLOCKS_PER_SM":  # a module constant then (benchmark sweeps set it)
                    mod.BLOCKS_PER_SM = v
                else:
                    os.environ[prefix + k] = v
            with plans.override("", base=plans.DEFAULT):
                yield
        finally:
            for k in switches:
                os.environ.pop(prefix + k, None)
            if bps is not None:
                mod.BLOCKS_PER_SM = bps
    return forced


def test_plans_match_the_old_code_case_by_case(monkeypatch):
    """The same grid through the source at BEFORE, its environment switches set where today's keys are: case by
    case, so a difference names its case (and the digests above are those of the old code)."""
    for var in list(os.environ):
        if var.startswith(("TWINSPARK_EXL3_GEMM_", "TWINSPARK_EXL3_MOE_")):
            monkeypatch.delenv(var)
    old_gemm = _old_module("python/twinspark/ops/exl3_gemm.py")
    old_moe = _old_module("python/twinspark/ops/exl3_moe.py")
    for name, old, new, digest in (
            ("exl3_gemm", _gemm_records(old_gemm.plan, _old_switches("TWINSPARK_EXL3_GEMM_", old_gemm)),
             _gemm_records(gemm_plan), GEMM_DIGEST),
            ("exl3_moe", _moe_records(old_moe.plan_launch, old_moe.gate_up_pdl,
                                      _old_switches("TWINSPARK_EXL3_MOE_", old_moe)),
             _moe_records(plan_launch, gate_up_pdl), MOE_DIGEST)):
        assert len(old) == len(new)
        for a, b in zip(old, new):
            assert a == b, f"{name} plan differs: {a} before, {b} now"
        assert _digest(old) == digest, f"{name}: {_digest(old)}"


def test_gemm_without_wgmma_takes_fused_mma_up_to_its_limit():
    """Without wgmma (GB10) prefill up to no_wgmma_mma_max_m goes to the fused mma.sync kernel, every layer size;
    above it the large path; 0 gives back the small-slice rule; sm_90 plans never pick it."""
    with plans.override("", base=plans.DEFAULT):
        for k, n in ((5120, 12288), (1152, 5120), (5120, 512)):
            assert gemm_plan(64, k, n, 3, 48, None, False).variant == "small"
            for m in (65, 256):
                p = gemm_plan(m, k, n, 3, 48, None, False)
                assert p.variant == "fused_mma" and p.block in (64, 128, 256)
                assert (p.splits - 1) * p.chunks_per_split < k // 64 <= p.splits * p.chunks_per_split
                assert gemm_plan(m, k, n, 3, 132, None, True).variant != "fused_mma"
            assert gemm_plan(257, k, n, 3, 48, None, False).variant == "large"
    with plans.override("exl3_gemm.no_wgmma_mma_max_m=0", base=plans.DEFAULT):
        assert gemm_plan(256, 5120, 12288, 3, 48, None, False).variant == "small"
        assert gemm_plan(256, 1152, 5120, 3, 48, None, False).variant == "large"


def test_fused_gemm_only_where_the_plan_has_enough_sms():
    """Plans made for fewer than fused_min_sms SMs (a 48-SM green context, bench_prefill.py) take the large path where
    the whole GPU takes the fused kernel (m = 65 ... 512 on sm_90)."""
    with plans.override("", base=plans.DEFAULT):
        for m in (65, 256, 512):
            assert gemm_plan(m, 5120, 1152, 3, 132, None, True).variant == "fused"
            assert gemm_plan(m, 5120, 1152, 3, 48, None, True).variant == "large"
        assert gemm_plan(64, 5120, 1152, 3, 48, None, True).variant == "small"
