"""Each part of a gateway request's state (``pdd.gateway.state``) is written by one module: the
sub-states by the owner their docstrings name, the top-level fields as ``ReqState``'s docstring
lists. Checked on the source (every assignment, augmented assignment and mutating call whose
target is a request's field, through a local alias of a sub-state too), so a write from another
module fails here rather than in a review."""

import ast
import dataclasses
from pathlib import Path

import pytest

from pdd.gateway import state as S

GATEWAY = Path(S.__file__).parent

# sub-state attribute of ReqState -> (its class, the module that writes it)
SUB_OWNERS = {"wan": (S.WanPlan, "wan_booking"), "handoff": (S.HandoffState, "handoff"),
              "recovery": (S.RecoveryState, "recovery"), "end": (S.EndState, "stream")}
# top-level fields -> the modules that write them (ReqState's docstring); the shared channels and
# logs (queue, events, decisions, md_settled, life) are appended to by any collaborator
TOP_OWNERS = {"trid": {"recovery"}, "base": {"recovery"}, "attempt": {"recovery"},
              "pipeline": {"launch"}, "p_cached_tokens": {"launch"}, "prompt_cached_tokens": {"launch"},
              "names": {"launch", "recovery"},
              "assigned": {"routing"}, "holds": {"routing"}, "md_cached_tokens": {"wan_booking"},
              "next_pos": {"handoff"}, "pending": {"handoff"}, "emitted": {"handoff"},
              "finished": {"stream"}, "last_token_s": {"stream"}}
SHARED = {"queue", "events", "decisions", "md_settled", "life"}
IDENTITY = {"rid", "prompt_len", "sampling", "prompt_ids", "t_arrival", "sibling_of", "siblings"}
MUTATORS = {"append", "clear", "pop", "update", "add", "extend", "setdefault", "discard", "remove", "insert",
            "popitem"}


def _targets(node) -> list:
    ts = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for t in ts:
        out.extend(t.elts if isinstance(t, ast.Tuple) else [t])
    return out


def _field(target, aliases: dict) -> str | None:
    """The request field ``target`` writes: "handoff.mode", "next_pos", ... or None."""
    while isinstance(target, ast.Subscript):  # st.events[k] = ..., st.handoff.md_pending[p] = ...
        target = target.value
    if not isinstance(target, ast.Attribute):
        return None
    v = target.value
    if isinstance(v, ast.Attribute) and v.attr in SUB_OWNERS:
        if target.attr in {f.name for f in dataclasses.fields(SUB_OWNERS[v.attr][0])}:
            return f"{v.attr}.{target.attr}"
        return None
    if isinstance(v, ast.Name):
        if v.id in aliases:
            return f"{aliases[v.id]}.{target.attr}"
        if v.id != "self" and target.attr in TOP_OWNERS.keys() | SHARED | IDENTITY | SUB_OWNERS.keys():
            return target.attr
    return None


def request_writes(root: Path = GATEWAY) -> list[tuple[str, str, int]]:
    """Every write of a request field under ``root``: [(module, field, line)]."""
    out = []
    for path in sorted(root.glob("*.py")):
        mod = path.stem
        if mod == "state":
            continue  # the definitions themselves
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            aliases = {}  # ho = st.handoff
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) \
                        and node.value.attr in SUB_OWNERS:
                    for t in _targets(node):
                        if isinstance(t, ast.Name):
                            aliases[t.id] = node.value.attr
            for node in ast.walk(fn):
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    for t in _targets(node):
                        f = _field(t, aliases)
                        if f is not None:
                            out.append((mod, f, node.lineno))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in MUTATORS:
                    f = _field(node.func.value, aliases)
                    if f is not None:
                        out.append((mod, f, node.lineno))
    return sorted(set(out))


def test_the_scanner_sees_direct_aliased_and_mutating_writes(tmp_path):
    (tmp_path / "x.py").write_text(
        "def f(st, o):\n"
        "    st.handoff.mode = 'one_shot'\n"
        "    ho = st.handoff\n"
        "    ho.switch_pos, st.next_pos = 3, 4\n"
        "    ho.md_pending.clear()\n"
        "    st.events['x'] = 1\n"
        "    st.recovery.recoveries.append({})\n"
        "    o.handoff.nothing = 1\n"  # not a HandoffState field
        "    self.pending = {}\n")
    assert request_writes(tmp_path) == [
        ("x", "events", 6), ("x", "handoff.md_pending", 5), ("x", "handoff.mode", 2),
        ("x", "handoff.switch_pos", 4), ("x", "next_pos", 4), ("x", "recovery.recoveries", 7)]


def test_every_field_is_owned_or_shared():
    names = {f.name for f in dataclasses.fields(S.ReqState)}
    assert names == TOP_OWNERS.keys() | SHARED | IDENTITY | SUB_OWNERS.keys()


@pytest.mark.parametrize("sub", sorted(SUB_OWNERS))
def test_a_sub_state_is_written_only_by_its_owner(sub):
    _cls, owner = SUB_OWNERS[sub]
    writes = [w for w in request_writes() if w[1].startswith(sub + ".")]
    assert writes, f"no writes of {sub} found: the scanner is blind"
    assert [w for w in writes if w[0] != owner] == []
    assert f"Written only by :mod:`pdd.gateway.{owner}`" in " ".join(SUB_OWNERS[sub][0].__doc__.split())


def test_top_level_fields_are_written_by_the_modules_state_py_names():
    bad = [w for w in request_writes() if w[1] in TOP_OWNERS and w[0] not in TOP_OWNERS[w[1]]]
    assert bad == []
    assert not [w for w in request_writes() if w[1] in IDENTITY]  # set at the start, never reassigned
