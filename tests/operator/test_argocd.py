"""The Argo CD health check for UniversalModel (examples/argocd/argocd-cm-health.yaml), run as Argo CD runs it
against the statuses the operator itself writes.

Argo CD runs a health script in gopher-lua, a Lua 5.1 VM in Go; these tests run it in Lua 5.1 (``lupa.lua51``) made
to look like Argo CD's VM where that is cheap, and check statically that the script uses nothing where the two
differ. The evidence, claim by claim:

- The VM (argoproj/argo-cd v3.5.1, ``util/lua/lua.go``, ``runLuaWithResourceActionParameters``; the same in
  v2.13.9): ``lua.NewState(lua.Options{SkipOpenLibs: !vm.UseOpenLibs})`` (``useOpenLibs`` is off unless the
  override sets it; this example does not), then only ``package`` (``OpenPackage``), base (``OpenBase``), ``table``
  (``OpenTable``) and a safe ``os`` of ``time`` and ``date`` (``util/lua/oslib_safe.go``, ``OpenSafeOs``). No
  ``string``, ``math``, ``io``, ``coroutine``, ``debug`` or ``channel``: ``string.format`` or ``("x"):lower()``
  would fail there (``OpenString`` also sets the strings' metatable). ``ARGO_CD_GLOBALS`` lists what that leaves
  (gopher-lua v1.1.2 ``baselib.go`` ``OpenBase``/``baseFuncs``, ``tablelib.go`` ``tableFuncs``, ``loadlib.go``);
  ``argo_cd_vm`` strips the Lua 5.1 runtime down to it (and lupa's ``python``).
- The object (``decodeValue`` in the same file): the resource as ``obj``, a global, and the script run as a
  chunk (``l.DoString(script)``, the returned value the top of the stack). JSON ``null`` -> ``nil``, so a field
  set to null is absent; numbers (``int64``/``float64`` in an Unstructured) -> ``LNumber``, a float64; arrays ->
  tables built with ``LTable.Append``, which skips ``nil`` (gopher-lua v1.1.2 ``table.go``), so ``[a, null, b]``
  arrives as ``{a, b}``; objects -> tables (``RawSetH``). ``to_lua`` does the same.
- The result (``ExecuteHealthLua``, same file): a returned table is JSON-encoded and read as a ``HealthStatus``
  (``status``, ``message``); a status other than ``Unknown``, ``Progressing``, ``Suspended``, ``Healthy``,
  ``Degraded``, ``Missing`` (``isValidHealthStatusCode``; argo-cd v3.5.1 ``gitops-engine/pkg/health/health.go``)
  becomes ``Unknown`` with "Lua returned an invalid health status"; ``nil`` becomes an empty status.
  ``argo_cd_health`` does the same.
- gopher-lua against Lua 5.1 (yuin/gopher-lua README, "Differences between Lua and GopherLua": ``README.md`` at
  v1.1.2, which argo-cd v3.5.1's go.mod requires; ``README.rst`` at v1.1.1, v2.13.9's, the same list): unsupported
  ``string.dump``, ``os.setlocale``, ``lua_Debug.namewhat``, ``package.loadlib``, debug hooks; ``collectgarbage``
  takes no arguments; ``file:setvbuf`` has no line buffering; no daylight saving time (``os.date``/``os.time``);
  ``os.setenv`` and ``goto``/``::label::`` (Lua 5.2) exist; the ``channel`` type. Beyond the README, from the source
  (v1.1.2 ``value.go``, ``LNumber.String``): a number becomes text as ``%d`` when integral (Lua 5.1: ``%.14g``, so
  ``1e+15`` against ``1000000000000000``); ``argo_cd_vm`` gives ``tostring`` that rule. ``#`` on a table with holes
  cannot differ: ``decodeValue`` leaves none. ``GOPHER_LUA_DIFFERS`` lists these; ``lua_usage`` scans the script.

Real gopher-lua is not run: Debian's package is from 2017, not v1.1.x, and no Go module proxy is reachable here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lupa.lua51 as lua51
import pytest
import yaml

from tests.factories import model
from tests.operator.test_kserve_status_documents import CASES as KSERVE_DOCUMENTS
from tests.operator.test_kserve_status_documents import the_model
from tests.operator.test_status_from_inference_service import CASES, QWEN, child
from universal_operator.config import OperatorConfig
from universal_operator.reconcile.status import status_for_invalid_spec, status_from_inference_service
from universal_operator.spec import GROUP, KIND, Phase, SpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "argocd"
HEALTH_KEY = f"resource.customizations.health.{GROUP}_{KIND}"
#: What each phase the operator reports means to someone looking at an Argo CD Application.
HEALTH = {
    Phase.READY: "Healthy",
    Phase.IDLE: "Healthy",  # scaled to zero is the normal resting state, not a fault
    Phase.PENDING: "Progressing",
    Phase.LOADING: "Progressing",
    Phase.FAILED: "Degraded",
}
#: isValidHealthStatusCode (argo-cd v3.5.1 util/lua/lua.go).
ARGO_CD_HEALTH_STATUSES = {"Unknown", "Progressing", "Suspended", "Healthy", "Degraded", "Missing"}
#: The globals of Argo CD's health VM (see the module docstring), less gopher-lua's own _printregs and
#: _GOPHER_LUA_VERSION, plus obj.
ARGO_CD_GLOBALS = {
    "_G", "_VERSION", "assert", "collectgarbage", "dofile", "error", "getfenv", "getmetatable", "load", "loadfile",
    "loadstring", "next", "pcall", "print", "rawequal", "rawget", "rawset", "select", "setfenv", "setmetatable",
    "tonumber", "tostring", "type", "unpack", "xpcall", "module", "require", "newproxy", "ipairs", "pairs",
    "package", "table", "os", "obj",
}  # fmt: skip
ARGO_CD_LIBRARIES = {"table": {"getn", "concat", "insert", "maxn", "remove", "sort"}, "os": {"time", "date"}}
#: Where gopher-lua's semantics differ from Lua 5.1 (see the module docstring): a script must use none.
GOPHER_LUA_DIFFERS = {
    "string.dump": "unsupported", "os.setlocale": "unsupported", "package.loadlib": "unsupported",
    "debug.sethook": "debug hooks are unsupported", "debug.getinfo": "lua_Debug.namewhat is unsupported",
    "collectgarbage": "takes no arguments and collects the whole Go program",
    "os.date": "no daylight saving time", "os.time": "no daylight saving time", "os.setenv": "gopher-lua only",
    "setvbuf": "no line buffering", "goto": "a Lua 5.2 statement", "::": "a Lua 5.2 label",
    "channel": "gopher-lua only",
}  # fmt: skip


def health_script() -> str:
    return str(yaml.safe_load((EXAMPLES / "argocd-cm-health.yaml").read_text())["data"][HEALTH_KEY])


def _number_text(value: float) -> str:
    """gopher-lua's LNumber.String: an integral value as an integer, whatever its size."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def argo_cd_vm() -> Any:
    """A Lua 5.1 runtime with only what Argo CD's health VM opens."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.execute("debug.getmetatable('').__index = nil")  # no string library: no methods on strings either
    strip = lua.eval(
        "function(keep, libraries, number_text)"
        "  local raw_tostring = tostring"
        "  tostring = function(v) if type(v) == 'number' then return number_text(v) end return raw_tostring(v) end"
        "  for name in pairs(_G) do if keep[name] == nil then _G[name] = nil end end"
        "  for library, functions in pairs(libraries) do"
        "    for name in pairs(_G[library]) do if functions[name] == nil then _G[library][name] = nil end end"
        "  end "
        "end"
    )
    keep = lua.table_from({name: True for name in ARGO_CD_GLOBALS})
    libraries = lua.table_from({k: lua.table_from({f: True for f in v}) for k, v in ARGO_CD_LIBRARIES.items()})
    strip(keep, libraries, _number_text)
    return lua


def to_lua(lua: Any, value: Any) -> Any:
    """``value`` as Argo CD's decodeValue hands it to the script."""
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items() if v is not None})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value if v is not None])
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return float(value)  # LNumber: a float64
    return None


def argo_cd_health(result: Any) -> dict[str, str]:
    """What ExecuteHealthLua makes of the script's return value."""
    if result is None:
        return {}
    status = {k: result[k] for k in ("status", "message") if result[k] is not None}
    if status.get("status") not in ARGO_CD_HEALTH_STATUSES:
        return {"status": "Unknown", "message": "Lua returned an invalid health status"}
    return status


def health(obj: dict[str, Any]) -> dict[str, str]:
    lua = argo_cd_vm()
    lua.globals().obj = to_lua(lua, obj)
    return argo_cd_health(lua.execute(health_script()))


def universal_model(status: dict[str, Any] | None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": KIND,
        "metadata": {"name": "qwen-chat", "namespace": "models", "generation": generation},
        "spec": {"task": "generate"},
    }
    if status is not None:
        obj["status"] = status
    return obj


@pytest.mark.parametrize("child_status", [None, *[case[0] for case in CASES.values()]], ids=["no child", *CASES])
def test_every_status_the_operator_writes_maps_to_the_health_its_phase_means(child_status: str | None) -> None:
    status = status_from_inference_service(None if child_status is None else child(child_status), model(QWEN))
    assert health(universal_model(status)) == {"status": HEALTH[Phase(status["phase"])], "message": status["message"]}


@pytest.mark.parametrize(("version", "knative", "child", "expected_yaml"), KSERVE_DOCUMENTS)
def test_the_status_of_every_kserve_release_document_maps_to_the_health_its_phase_means(
    version: str, knative: bool, child: dict[str, Any], expected_yaml: str
) -> None:
    config = OperatorConfig.model_validate({"kserve": {"version": version}})
    status = status_from_inference_service(child, the_model(knative), config=config)
    assert health(universal_model(status)) == {"status": HEALTH[Phase(status["phase"])], "message": status["message"]}


def test_an_invalid_spec_is_degraded_with_the_operators_message() -> None:
    body = universal_model(None)
    status = status_for_invalid_spec(body, SpecError("spec.resources.profile", "no profile 'h100'"))
    result = health(universal_model(status))
    assert result["status"] == "Degraded"
    assert "spec.resources.profile" in result["message"]


def test_a_model_the_operator_has_not_reported_on_yet_is_progressing() -> None:
    assert health(universal_model(None))["status"] == "Progressing"


def test_a_spec_change_the_operator_has_not_observed_yet_is_progressing_not_the_old_health() -> None:
    ready = status_from_inference_service(child(CASES[next(iter(CASES))][0]), model(QWEN))
    ready.update(phase="Ready", message="Serving.")
    assert health(universal_model(ready, generation=3))["status"] == "Healthy"
    result = health(universal_model(ready, generation=4))  # edited in Git, synced, not yet reconciled
    assert result == {"status": "Progressing", "message": "Waiting for the operator to observe generation 4."}


def test_the_application_example_syncs_a_folder_with_pruning_and_self_heal() -> None:
    app = yaml.safe_load((EXAMPLES / "application.yaml").read_text())
    assert (app["apiVersion"], app["kind"]) == ("argoproj.io/v1alpha1", "Application")
    assert app["spec"]["syncPolicy"]["automated"] == {"prune": True, "selfHeal": True}
    assert app["spec"]["source"]["path"]


# --------------------------------------------------------------------------------------------------
# the sandbox and the script, against Argo CD's VM and gopher-lua


_LUA_KEYWORDS = {"and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in", "local",
                 "nil", "not", "or", "repeat", "return", "then", "true", "until", "while", "goto"}  # fmt: skip
_LUA_TOKEN = re.compile(r"::|\.\.\.?|==|~=|<=|>=|[A-Za-z_]\w*|0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\S")


@dataclass
class LuaUsage:
    """What a script reaches for: the globals it reads or writes, the fields of globals it names (``os.time``), its
    method calls (``x:lower()``) and the statements it uses (``goto``, ``::``)."""

    globals: set[str] = field(default_factory=set)
    global_fields: set[str] = field(default_factory=set)
    methods: set[str] = field(default_factory=set)
    statements: set[str] = field(default_factory=set)


def lua_tokens(script: str) -> list[str]:
    """The script's tokens, comments dropped and every string literal as one ``"…"`` token."""
    script = re.sub(r"--\[(=*)\[.*?\]\1\]|--[^\n]*", " ", script, flags=re.S)
    script = re.sub(r"\[(=*)\[.*?\]\1\]|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'", ' "…" ', script, flags=re.S)
    return _LUA_TOKEN.findall(script)


def lua_usage(script: str) -> LuaUsage:
    """A scan of the script's names; locals (``local x``, function parameters, ``for`` variables) are not globals.
    Scope is the whole script: good enough to show that no global outside Argo CD's VM is ever named."""
    tokens = lua_tokens(script)
    usage, local_names = LuaUsage(), set()
    for i, token in enumerate(tokens):
        before = tokens[i - 1] if i else ""
        if token in ("goto", "::"):
            usage.statements.add(token)
        if before == "local" or (before == "," and tokens[i - 2] in local_names) or before == "for":
            local_names.add(token)
        if before == "function" or (before in ("(", ",") and "function" in tokens[max(0, i - 3) : i]):
            local_names.add(token)
    for i, token in enumerate(tokens):
        before = tokens[i - 1] if i else ""
        after = tokens[i + 1] if i + 1 < len(tokens) else ""
        if not re.fullmatch(r"[A-Za-z_]\w*", token) or token in _LUA_KEYWORDS or token in local_names:
            if before == ":" and re.fullmatch(r"[A-Za-z_]\w*", token):
                usage.methods.add(token)
            continue
        if before in (".", ":"):
            if before == ":":
                usage.methods.add(token)
            continue
        if after == "=" and before in ("{", ","):
            continue  # a key in a table constructor
        usage.globals.add(token)
        if after == "." and i + 2 < len(tokens):
            usage.global_fields.add(f"{token}.{tokens[i + 2]}")
    return usage


def gopher_lua_problems(script: str) -> list[str]:
    """What in ``script`` would behave differently, or fail, in Argo CD's gopher-lua VM."""
    usage = lua_usage(script)
    problems = [f"global {name!r}: not in Argo CD's VM" for name in sorted(usage.globals - ARGO_CD_GLOBALS)]
    for library, functions in ARGO_CD_LIBRARIES.items():
        problems += [f"{name}: not in Argo CD's VM" for name in sorted(usage.global_fields)
                     if name.startswith(f"{library}.") and name.split(".", 1)[1] not in functions]  # fmt: skip
    problems += [f"{m}(): a method call (no string library in Argo CD's VM)" for m in sorted(usage.methods)]
    named = usage.globals | usage.global_fields | usage.methods | usage.statements
    problems += [f"{name}: {why}" for name, why in GOPHER_LUA_DIFFERS.items() if name in named]
    return problems


def test_the_health_script_uses_nothing_where_gopher_lua_or_argo_cds_vm_differs_from_lua_51() -> None:
    usage = lua_usage(health_script())
    assert usage.globals == {"obj", "tostring"}  # the scan sees the script: a change here is worth a look
    assert gopher_lua_problems(health_script()) == []


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('hs.message = string.format("%d", obj.metadata.generation)', "global 'string': not in Argo CD's VM"),
        ("hs.message = obj.status.message:lower()", "lower(): a method call"),
        ("if obj.status == nil then goto done end", "goto: a Lua 5.2 statement"),
        ("::done::", "::: a Lua 5.2 label"),
        ("collectgarbage()", "collectgarbage: takes no arguments"),
        ('hs.message = os.date("%H:%M")', "os.date: no daylight saving time"),
        ("os.exit(1)", "os.exit: not in Argo CD's VM"),
        ("local n = math.floor(obj.metadata.generation)", "global 'math': not in Argo CD's VM"),
    ],
)  # fmt: skip
def test_the_scan_catches_what_would_differ_in_gopher_lua(line: str, problem: str) -> None:
    script = health_script().replace("local message = ", f"{line}\n    local message = ", 1)
    assert any(found.startswith(problem) for found in gopher_lua_problems(script)), gopher_lua_problems(script)


def test_the_scan_reads_past_strings_comments_and_locals() -> None:
    script = '-- string.format here is a comment\nlocal math = {}\nlocal s = "os.exit() goto"\nreturn {status = s}'
    assert gopher_lua_problems(script) == []


def test_the_sandbox_has_only_the_libraries_argo_cd_opens() -> None:
    lua = argo_cd_vm()
    globals_ = lua.globals()
    assert set(globals_) == ARGO_CD_GLOBALS - {"obj"}
    for library, functions in ARGO_CD_LIBRARIES.items():
        assert set(globals_[library]) == functions
    with pytest.raises(lua51.LuaError):
        lua.execute("return ('Ready'):lower()")  # OpenString is what gives strings their methods
    assert lua.execute("return tostring(1e15)") == "1000000000000000"  # gopher-lua's LNumber.String


def test_objects_reach_the_script_as_argo_cds_decode_value_makes_them() -> None:
    lua = argo_cd_vm()
    lua.globals().obj = to_lua(lua, {"a": None, "list": ["x", None, "y"], "n": 3, "flag": False})
    assert lua.execute("return obj.a == nil, #obj.list, obj.list[2], type(obj.n), obj.flag") == (
        True, 2, "y", "number", False)  # fmt: skip


@pytest.mark.parametrize(
    "status",
    [
        None,
        {},
        {"observedGeneration": 3},
        {"observedGeneration": 3, "phase": None, "message": None},
        {"observedGeneration": 3, "phase": "Ready"},
        {"observedGeneration": 3, "phase": "Exploding", "message": "?"},
        {"observedGeneration": 2, "phase": "Ready", "message": "Serving."},
        *[status_from_inference_service(child(case[0]), model(QWEN)) for case in CASES.values()],
    ],
)
def test_the_script_always_returns_a_health_status_argo_cd_accepts_and_a_message(status: Any) -> None:
    result = health(universal_model(status))
    assert result["status"] in ARGO_CD_HEALTH_STATUSES - {"Missing", "Suspended"}
    assert result["message"]
    assert result["message"] != "Lua returned an invalid health status"


def test_every_status_the_script_can_set_is_one_argo_cd_accepts() -> None:
    # Statically, so a branch no status above reaches is covered too: a typo ("Healty") would read as Unknown.
    assigned = set(re.findall(r"\bstatus\s*=\s*\"(\w*)\"", health_script()))
    assert assigned == {"Progressing", "Degraded", "Healthy", "Unknown"}
    assert assigned <= ARGO_CD_HEALTH_STATUSES
