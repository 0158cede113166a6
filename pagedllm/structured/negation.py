"""JSON-schema logic in the positive terms llguidance implements: ``not`` and
``if`` / ``then`` / ``else`` rewritten as ``anyOf`` / ``allOf`` of schemas it compiles,
in keywords every draft reads alike (``enum``, not draft 6's ``const``, which a draft 4
schema ignores).

Every rewrite accepts exactly the values the original does, but one: a switch of more
than ``MAX_ABSENT_CASES`` cases on a property its object does not require generates
no object that lacks the property (such an object must hold every case's ``then`` at
once); what is generated still validates.
"""

from __future__ import annotations

import re
from typing import Any, Callable

# Keywords that say nothing of which values a schema accepts.
ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly"}
# JSON's types, ``integer`` within ``number``.
TYPES = ("null", "boolean", "object", "array", "string", "number")
MAX_ABSENT_CASES = 4
# Conditionals of a schema rewritten one by one (each an ``anyOf`` of two branches that the
# backend intersects with the others), beyond those merged into a switch.
MAX_LONE_CONDITIONALS = 4


# The schema a lone ``$ref`` names (the backend's resolver), the schema itself if it is no
# reference, None where it names none.
Resolve = Callable[[Any], Any]
# Length bounds: the type they constrain, and the opposite bound.
_LENGTH_BOUNDS = {"minLength": ("string", "maxLength"), "maxLength": ("string", "minLength"),
                  "minItems": ("array", "maxItems"), "maxItems": ("array", "minItems")}


def _itself(schema: Any) -> Any:
    return schema


def names(value: Any) -> set[str] | None:
    """The strings of a list of strings (``required``, ``type``); None for anything else."""
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return set(value)
    return None


def not_in_positive_terms(node: dict, resolve: Resolve = _itself) -> None:
    """A ``not`` whose negation ``negation`` knows becomes that negation in the node's
    ``allOf``; any other is left for the backend to refuse, naming ``not``. Runs after
    the objects are closed: a negation never names a property to allow."""
    if "not" in node:
        positive = negation(node["not"], resolve=resolve)
        if positive is not None:
            del node["not"]
            node.setdefault("allOf", []).append(positive)


def negation(schema: Any, depth: int = 0, resolve: Resolve = _itself) -> Any:
    """A schema that holds exactly where ``schema`` does not, or None where none is known:

    - ``{}`` / ``true`` and ``false`` swap;
    - ``{"type": T}``: the other types (None for ``integer`` without ``number``: "a number
      that is not an integer" has no type);
    - ``const`` / ``enum`` of strings, numbers, booleans and null (with or without a
      ``type``): every other value (``_other_values``);
    - ``properties`` whose schemas have negations, with ``required`` names among them or
      not (``type: object`` or none): objects where a listed property is present and fails
      its schema, or a required one is absent; every other value passes, so fails the
      ``not`` (unless the schema says ``type: object``);
    - ``pattern`` of one character class repeated (``^\\s*$``, ``^[a-z]+$``, ``[^ -~]``,
      ``\\$``): the strings it does not match (``pattern_complement``), and the other
      types where the schema says ``type: string``;
    - ``minLength`` / ``maxLength`` / ``minItems`` / ``maxItems`` (with a ``type`` or
      none): the strings or arrays out of the bound, and the other types where the schema
      says one;
    - ``anyOf`` and ``allOf`` of negatable schemas: ``allOf`` and ``anyOf`` of their
      negations, and a ``oneOf`` of one branch that branch's;
    - a lone ``$ref``: its target's negation (``resolve``);
    - a lone ``not``: the schema it negates."""
    schema = resolve(schema)
    if schema is False:
        return True
    if schema is True or (isinstance(schema, dict) and set(schema) <= ANNOTATIONS):
        return False
    if not isinstance(schema, dict) or depth > 8:
        return None
    keys = set(schema) - ANNOTATIONS
    if keys == {"type"}:
        named = names([schema["type"]] if isinstance(schema["type"], str) else schema["type"])
        if named is None or ("integer" in named and "number" not in named):
            return None
        others = [t for t in TYPES if t not in named]
        return {"type": others} if others else False
    if keys == {"not"}:
        return schema["not"]
    if keys & {"const", "enum"} and keys <= {"const", "enum", "type"}:
        return _other_values(schema)
    if keys & {"properties", "required"} and keys <= {"properties", "required", "type"}:
        return _objects_failing(schema, depth, resolve)
    if "pattern" in keys and keys <= {"pattern", "type"} \
            and schema.get("type", "string") == "string":
        return _strings_failing(schema)
    if len(keys - {"type"}) == 1 and (keys - {"type"}) <= set(_LENGTH_BOUNDS):
        return _out_of_bound(schema, (keys - {"type"}).pop())
    if keys == {"oneOf"} and isinstance(schema["oneOf"], list) and len(schema["oneOf"]) == 1:
        return negation(schema["oneOf"][0], depth + 1, resolve)  # one branch: that branch
    if len(keys) == 1 and keys <= {"anyOf", "allOf"}:
        key = keys.pop()
        parts = [negation(part, depth + 1, resolve) for part in schema[key]] \
            if isinstance(schema[key], list) else [None]
        if any(part is None for part in parts):
            return None
        return {"allOf" if key == "anyOf" else "anyOf": parts}
    return None


def _out_of_bound(schema: dict, bound: str) -> Any:
    """The negation of one length bound (/ ``type``), or None."""
    limit = schema[bound]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        return None
    kind, opposite = _LENGTH_BOUNDS[bound]
    if bound.startswith("min"):
        failing = {"type": kind, opposite: limit - 1} if limit > 0 else False
    else:
        failing = {"type": kind, opposite: limit + 1}
    if "type" not in schema:
        return failing  # every value of another type holds the bound
    other_types = negation({"type": schema["type"]})
    declared = names([schema["type"]] if isinstance(schema["type"], str) else schema["type"])
    if other_types is None or declared is None or kind not in declared:
        return other_types  # the bound does not apply to the type said
    parts = [part for part in (other_types, failing) if part is not False]
    return {"anyOf": parts} if len(parts) > 1 else (parts[0] if parts else False)


def _objects_failing(schema: dict, depth: int, resolve: Resolve = _itself) -> Any:
    """The negation of ``properties`` / ``required`` (/ ``type: object``), or None."""
    properties = schema.get("properties", {})
    required = names(schema.get("required", []))
    if not isinstance(properties, dict) or required is None \
            or schema.get("type", "object") != "object":
        return None
    failing = []
    for name, value in properties.items():
        fails = negation(value, depth + 1, resolve)
        if fails is None:
            return None
        if fails is not False:
            failing.append({"required": [name], "properties": {name: fails}})
    failing += [{"properties": {name: False}} for name in sorted(required)]
    objects_failing = {"type": "object", "anyOf": failing} if failing else False
    if "type" not in schema:
        return objects_failing
    return {"anyOf": [{"type": [t for t in TYPES if t != "object"]}, objects_failing]}


def _strings_failing(schema: dict) -> Any:
    """The negation of ``pattern`` (/ ``type: string``), or None."""
    complement = pattern_complement(schema["pattern"]) \
        if isinstance(schema["pattern"], str) else None
    if complement is None:
        return None
    strings = {"type": "string", "pattern": complement} if complement is not False else False
    if "type" not in schema:
        return strings  # every other value holds ``pattern``
    others = {"type": [t for t in TYPES if t != "string"]}
    return others if strings is False else {"anyOf": [others, strings]}


# A regex of one character class, repeated: ``^``? a group? the class (a bracket
# expression, ``\s``-like, an escaped or a plain character, or ``.``), its repetition,
# the group's end, ``$``?
_CLASS = r"\[(?:\\.|[^\]\\])+\]|\\[sSdDwW]|\\[^a-zA-Z0-9]|[^\\\[\](){}|*+?^$.]|\."
_REPEAT = r"[*+?]|\{\d+(?:,\d*)?\}"
_ONE_CLASS = re.compile(rf"(?P<start>\^)?(?P<open>\((?:\?:)?)?(?P<cls>{_CLASS})"
                        rf"(?P<inner>{_REPEAT})?\??(?P<close>\))?(?P<outer>{_REPEAT})?\??"
                        r"(?P<end>\$)?")


# A regex of literal strings, one or an alternation of them, anchored at the start, and at
# the end or not (then any string that starts with one matches).
_LITERAL = r"(?:[^\\\[\](){}|*+?^$.]|\\[^a-zA-Z0-9])+"
_LITERALS = re.compile(
    rf"\^(?:\((?:\?:)?({_LITERAL}(?:\|{_LITERAL})*)\)|({_LITERAL}))(?P<end>\$)?")
# A regex of character classes in a row, anchored at the start only: their prefix.
_CLASS_ROW = re.compile(rf"\^(?P<open>\((?:\?:)?)?(?P<row>(?:{_CLASS})+)(?P<close>\))?")


def pattern_literals(pattern: str) -> tuple[list[str], bool] | None:
    """The strings a pattern of literal strings names (``^(get|post)$``, ``^a\\.b``), and
    whether it is anchored at the end too (then it matches them alone, else every string
    that starts with one); None for any other pattern."""
    literals = _LITERALS.fullmatch(pattern)
    if literals is None:
        return None
    words = re.findall(_LITERAL, literals[1] or literals[2])
    return [re.sub(r"\\(.)", r"\1", word) for word in words], bool(literals["end"])


def pattern_complement(pattern: str) -> str | bool | None:
    """An anchored regex of exactly the strings JSON Schema's ``pattern`` (a search: it
    may match anywhere unless anchored) does not match, for a pattern of one character
    class repeated ``{m,n}`` times (``_ONE_CLASS``), of strings named literally
    (``^tuple$``, ``^(get|post)$``: every other string; ``^(get|post)``: every string
    that starts with neither), or of character classes in a row at the start
    (``^[iI][oO]``: every string that does not start so); False where every string
    matches; None for any other pattern. With ``C`` the class and ``D`` its complement:

    - ``^C{m,n}$``: fewer than m or more than n characters, or one of D;
    - ``^C{m,n}``: fewer than m characters of C before the first of D or the end;
    - ``C{m,n}$``: fewer than m after the last of D;
    - ``C{m,n}``: no run of m characters of C."""
    literals = pattern_literals(pattern)
    if literals is not None:
        words, whole = literals
        return _other_strings_pattern(words, prefixes=not whole)
    row = _CLASS_ROW.fullmatch(pattern)
    if row is not None and bool(row["open"]) == bool(row["close"]):
        return _not_starting_with([_class_and_complement(c)
                                   for c in re.findall(_CLASS, row["row"])])
    found = _ONE_CLASS.fullmatch(pattern)
    if found is None or bool(found["open"]) != bool(found["close"]) \
            or (found["inner"] and found["outer"]):
        return None
    low, high = _repetition(found["inner"] or found["outer"])
    if high is not None and high < low:
        return None
    cls, other = _class_and_complement(found["cls"])
    anyway = r"[\s\S]*"
    short = f"{cls}{{0,{low - 1}}}" if low > 0 else None
    if found["start"] and found["end"]:
        parts = [p for p in (short, f"{cls}{{{high + 1},}}" if high is not None else None)
                 if p]
        return f"^(?:{'|'.join(parts + [anyway + other + anyway])})$"
    if low == 0:
        return False
    if found["start"]:
        return f"^{short}(?:{other}{anyway})?$"
    if found["end"]:
        return f"^(?:{anyway}{other})?{short}$"
    if low == 1:
        return f"^{other}*$"
    return f"^{other}*(?:{cls}{{1,{low - 1}}}{other}+)*{short}$"


def _repetition(repeat: str | None) -> tuple[int, int | None]:
    """(least, most or None) of a repetition's text."""
    if repeat is None:
        return 1, 1
    if repeat in ("*", "+", "?"):
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[repeat]
    low, _, high = repeat[1:-1].partition(",")
    if not _:
        return int(low), int(low)
    return int(low), int(high) if high else None


def _class_and_complement(text: str) -> tuple[str, str]:
    """A character class's text as a bracket expression or an escape, and its complement's."""
    if text.startswith("["):
        inner = text[1:-1]
        if inner.startswith("^"):
            return text, f"[{inner[1:]}]"
        return text, f"[^{inner}]"
    if text in ("\\s", "\\S", "\\d", "\\D", "\\w", "\\W"):
        return text, text.swapcase()
    if text == ".":
        return ".", "\\n"
    return text, f"[^{text}]"


def _scalar_values(schema: dict) -> list | None:
    """The values a ``const`` / ``enum`` schema holds (those its ``type`` allows), or None
    where one is an object or an array."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list) or any(isinstance(v, (dict, list)) for v in values):
        return None
    declared = schema.get("type")
    declared = names([declared] if isinstance(declared, str) else declared) \
        if declared is not None else set(TYPES) | {"integer"}
    if declared is None:
        return None
    return [v for v in values if json_type(v) in declared
            or (json_type(v) == "integer" and "number" in declared)
            or (json_type(v) == "number" and float(v).is_integer() and "integer" in declared)]


def json_type(value: Any) -> str:
    """A JSON value's type: ``integer`` for an int, ``number`` for a float."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "string"


def _other_values(schema: dict) -> Any:
    """Every JSON value but the scalars a ``const`` / ``enum`` schema holds, or None."""
    values = _scalar_values(schema)
    if values is None:
        return None
    strings = sorted({v for v in values if isinstance(v, str)})
    numbers = sorted({float(v) for v in values if json_type(v) in ("integer", "number")})
    booleans = {v for v in values if isinstance(v, bool)}
    branches: list[dict] = [{"type": ["object", "array"]}]
    branches.append({"type": "string", "pattern": _other_strings_pattern(strings)}
                    if strings else {"type": "string"})
    if not numbers:
        branches.append({"type": "number"})
    else:
        bounds = [None, *numbers, None]
        for low, high in zip(bounds, bounds[1:]):
            # Bounds said both ways, so that draft 4 (a boolean beside the bound) and later
            # drafts (the bound itself) read the same interval.
            interval: dict = {"type": "number"}
            if low is not None:
                interval.update(minimum=_plain(low), exclusiveMinimum=_plain(low))
            if high is not None:
                interval.update(maximum=_plain(high), exclusiveMaximum=_plain(high))
            branches.append(interval)
    branches += [{"enum": [b]} for b in (False, True) if b not in booleans]
    if None not in values:
        branches.append({"type": "null"})
    return {"anyOf": branches}


def _plain(number: float) -> int | float:
    return int(number) if number.is_integer() else number


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _escaped(char: str) -> str:
    return "\\" + char if char in _REGEX_META else char


def _other_strings_pattern(excluded: list[str], prefixes: bool = False) -> str | bool:
    """An anchored regex of every string but those ``excluded`` (``prefixes``: but those
    that start with one of them; False where that is every string): at each node of their
    trie, a character that leads to no excluded string and then anything, a character that
    does and the rest of its branch, or the end where no excluded string ends. With
    ``prefixes``, a branch stops where an excluded string ends: no string goes on from
    there."""
    trie: dict = {}
    for word in excluded:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    if prefixes and "" in trie:
        return False

    def other(node: dict) -> str:
        kids = sorted(k for k in node if k)
        leave = f"[^{''.join(_escaped(k) for k in kids)}][\\s\\S]*" if kids else "[\\s\\S]+"
        onward = [_escaped(k) + other(node[k]) for k in kids if not (prefixes and "" in node[k])]
        body = "|".join([leave] + onward)
        return f"(?:{body})" if "" in node and not prefixes else f"(?:{body})?"

    return f"^{other(trie)}$"


def _not_starting_with(classes: list[tuple[str, str]]) -> str:
    """An anchored regex of the strings that do not start with a character of each class
    in turn (``(class, complement)`` pairs): they end, or hold the complement's character,
    before the row is through."""
    tail = ""
    for cls, other in reversed(classes):
        tail = f"(?:{other}[\\s\\S]*|{cls}{tail})?" if tail else f"(?:{other}[\\s\\S]*)?"
    return f"^{tail}$"


def conditionals_as_any_of(node: dict, pinned: set[tuple[int, str]] = frozenset(),
                           resolve: Resolve = _itself) -> None:
    """The node's ``if`` / ``then`` / ``else``, and its ``allOf`` members that are only
    that, in terms of ``anyOf``. Those whose ``if`` tests one property against constants
    (``{"properties": {"kind": {"const": "a"}}}``, the way real-world schemas switch on a
    discriminator) merge into one ``anyOf`` with a branch per case, one for a value of no
    case and one for the property absent, when the node is an object schema; the rest
    become ``anyOf: [allOf [if, then], allOf [negation of if, else]]`` each, when the
    ``if`` has a known ``negation`` and they are few. Anything else is left for the
    backend to refuse, naming ``if``, and so are the conditionals of a node that a
    reference's pointer passes through (``pinned``: container ids and keys) on its way to
    what they hold. A ``then`` or ``else`` without an ``if`` is left out (it has no
    effect)."""
    if any((id(node), key) in pinned for key in ("if", "then", "else", "allOf")):
        return
    if "if" not in node:  # a ``then`` or ``else`` without an ``if`` has no effect
        node.pop("then", None)
        node.pop("else", None)
    conditionals = []
    if "if" in node:
        conditionals.append(node)
    members = node.get("allOf")
    if isinstance(members, list):
        conditionals += [m for m in members if isinstance(m, dict) and "if" in m
                         and set(m) - ANNOTATIONS <= {"if", "then", "else"}]
    if not conditionals:
        return
    rewritten = []
    switches: dict[str, list] = {}
    lone = []
    for conditional in conditionals:
        case = _switch_case(conditional["if"]) if node.get("type") == "object" else None
        if case is not None:
            switches.setdefault(case[0], []).append((case, conditional))
        else:
            lone.append(conditional)
    for name, cases in switches.items():
        branches = _switch_branches(name, cases, name in (names(node.get("required")) or ()))
        if branches is None:
            lone += [conditional for _, conditional in cases]
        else:
            rewritten.append(({"anyOf": branches}, [c for _, c in cases]))
    if len(lone) <= MAX_LONE_CONDITIONALS:
        for conditional in lone:
            otherwise = negation(conditional["if"], resolve=resolve)
            if otherwise is not None:
                rewritten.append(({"anyOf": [
                    _all_of([conditional["if"], conditional.get("then", True)]),
                    _all_of([otherwise, conditional.get("else", True)])]}, [conditional]))
    for any_of, done in rewritten:
        for conditional in done:
            if conditional is node:
                for key in ("if", "then", "else"):
                    node.pop(key, None)
            else:
                node["allOf"] = [m for m in node["allOf"] if m is not conditional]
        node.setdefault("allOf", []).append(any_of)
    if node.get("allOf") == []:
        del node["allOf"]


def _switch_case(test: Any) -> tuple[str, list, bool] | None:
    """``(name, values, required)`` for an ``if`` that tests one property against constant
    scalars (and perhaps requires it); None for any other."""
    if not isinstance(test, dict) or not set(test) - ANNOTATIONS <= {"properties", "required",
                                                                        "type"}:
        return None
    properties = test.get("properties")
    if not isinstance(properties, dict) or len(properties) != 1 \
            or test.get("type", "object") != "object":
        return None
    (name, value), = properties.items()
    required = names(test.get("required", []))
    if required is None or not required <= {name} or not isinstance(value, dict) \
            or not set(value) - ANNOTATIONS <= {"const", "enum", "type"}:
        return None
    values = _scalar_values(value)
    return None if values is None else (name, values, bool(required))


def _switch_branches(name: str, cases: list, name_required: bool) -> list | None:
    """The ``anyOf`` branches of the conditionals ``cases`` (``((name, values, required),
    conditional)``) that switch on property ``name``; None where two cases share a value
    or "none of the values" has no known negation."""
    seen: list = []
    for (_, values, _), _ in cases:
        if any(_same_value(v, s) for v in values for s in seen):
            return None
        seen += values
    none_of = _other_values({"enum": seen})
    if none_of is None:
        return None
    thens = [c.get("then", True) for _, c in cases]
    elses = [c.get("else", True) for _, c in cases]
    branches = []
    for i, ((_, values, _), _) in enumerate(cases):
        others = [e for j, e in enumerate(elses) if j != i]
        branches.append(_all_of([{"required": [name], "properties": {name: {"enum": values}}},
                                 thens[i], *others]))
    branches.append(_all_of([{"required": [name], "properties": {name: none_of}}, *elses]))
    if not name_required and len(cases) <= MAX_ABSENT_CASES:
        holds = [thens[i] if not required else elses[i]
                 for i, ((_, _, required), _) in enumerate(cases)]
        branches.append(_all_of([{"properties": {name: False}}, *holds]))
    return branches


def _same_value(a: Any, b: Any) -> bool:
    """JSON equality of scalars: ``1`` equals ``1.0``, ``true`` equals no number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _all_of(parts: list) -> Any:
    """The conjunction of ``parts``, without the ones that always hold."""
    parts = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in parts):
        return False
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}
