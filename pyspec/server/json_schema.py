"""JSON Schema -> GBNF grammar: constrained output for ``json_schema`` and ``response_format``.

llama-server turns a request's JSON schema into a grammar (common/json-schema-to-grammar.cpp, C++ that
pyspec cannot call: it takes an nlohmann::json). This is pyspec's own converter for the part of JSON
Schema that constrains structure; every document the grammar accepts is valid under the schema, and
a keyword it cannot enforce is refused with ValueError naming it rather than ignored:

- ``type`` (one or a list): object, array, string, number, integer, boolean, null;
- ``const``, ``enum``; ``anyOf`` / ``oneOf`` (either matches); ``allOf`` of object schemas (merged);
- objects: ``properties`` (written in their order, those not in ``required`` optional),
  ``additionalProperties`` (a schema, or true, for objects without ``properties``; with ``properties``
  no other key is written, which the schema allows);
- arrays: ``items`` (a schema, or a list: a tuple), ``prefixItems``, ``minItems`` / ``maxItems``;
- strings: ``minLength`` / ``maxLength``; ``format`` is an annotation (JSON Schema's default) and not
  enforced; ``pattern`` is refused;
- numbers: ``minimum`` 0 on an integer (no sign); other bounds are refused;
- ``$ref`` to ``#/definitions/...`` or ``#/$defs/...`` (recursion allowed); an empty schema or
  ``true`` is any JSON value.

Whitespace between tokens is bounded (a space, or a new line and up to 20 blanks), as in llama.cpp's
rules, so a model cannot spin in whitespace forever.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["json_schema_to_grammar"]

_PRIMITIVES = {
    "space": '| " " | "\\n" [ \\t]{0,20}',
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "integral-part": "[0] | [1-9] [0-9]{0,15}",
    "decimal-part": "[0-9]{1,16}",
    "integer": '("-"? integral-part) space',
    "unsigned-integer": "integral-part space",
    "number": '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)? space',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4})',
    "string": '"\\"" char* "\\"" space',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space',
    "array": '"[" space ( value ("," space value)* )? "]" space',
}
# what each primitive rule uses
_DEPENDS = {"boolean": ["space"], "null": ["space"], "integer": ["integral-part", "space"],
            "unsigned-integer": ["integral-part", "space"],
            "number": ["integral-part", "decimal-part", "space"], "string": ["char", "space"],
            "value": ["object", "array", "string", "number", "boolean", "null"],
            "object": ["string", "space", "value"], "array": ["value", "space"]}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# keywords that say nothing about what is valid (annotations), or that this converter handles
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "format",
                "readOnly", "writeOnly", "deprecated", "definitions", "$defs", "strict", "name"}
_HANDLED = {"type", "const", "enum", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
            "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
            "minimum"}
# minItems / maxItems / string lengths beyond this are refused: llama.cpp's grammar parser refuses a repetition
# of more (MAX_REPETITION_THRESHOLD in src/llama-grammar.cpp)
_MAX_REPEAT = 2000


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value_literal(v: Any, where: str) -> str:
    # the value as compact JSON text, then any whitespace
    try:
        text = json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # NaN and infinities are not JSON: the model would write them
        raise ValueError(f"{where}: a 'const' or 'enum' value must be JSON (no NaN or infinity)") from None
    return _literal(text) + " space"


class _Converter:
    def __init__(self, root: Any, max_chars: int | None) -> None:
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}  # $ref -> its rule name
        # the grammar's size so far: a schema whose grammar grows with each level ("type": [...] repeats the
        # schema per type, an array's item is written twice) is refused as it grows, not once it is built
        self.max_chars = max_chars
        self.n_chars = 0

    def _grow(self, text: str) -> str:
        """``text`` is part of the grammar (a rule's body, or an expression inside one); ValueError past the limit."""
        if self.max_chars is not None:
            self.n_chars += len(text)
            # one expression past the limit (the exponential case stops within a level or two), or all the
            # text built so far past a generous multiple (many siblings; an inline expression counts once
            # per level it is part of, so a legitimate deep schema counts some times its grammar)
            if len(text) > self.max_chars or self.n_chars > 64 * self.max_chars:
                raise ValueError(f"its grammar would be more than the {self.max_chars} characters allowed")
        return text

    def use(self, name: str) -> str:
        """A primitive rule (and those it uses) added to the grammar; its name."""
        if name not in self.rules:
            self.rules[name] = _PRIMITIVES[name]
            for dep in _DEPENDS.get(name, []):
                self.use(dep)
        return name

    def add(self, hint: str, body: str) -> str:
        """A new rule named after ``hint``; its name."""
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-") or "r"
        name, i = base, 1
        while name in self.rules or name in _PRIMITIVES:
            i += 1
            name = f"{base}-{i}"
        self.rules[name] = self._grow(body)
        return name

    def visit(self, schema: Any, hint: str, where: str) -> str:
        """A GBNF expression for ``schema`` (rules it needs are added)."""
        return self._grow(self._visit(schema, hint, where))

    def _visit(self, schema: Any, hint: str, where: str) -> str:
        if schema is True or schema == {}:
            return self.use("value")
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where}: a schema must be an object, got {type(schema).__name__}")
        unknown = sorted(set(schema) - _HANDLED - _ANNOTATIONS)
        if unknown:
            raise ValueError(f"{where}: unsupported keyword {unknown[0]!r}")
        if "$ref" in schema:
            return self.ref(schema["$ref"], where)
        if "const" in schema or "enum" in schema:
            self.use("space")
        if "const" in schema:
            return _value_literal(schema["const"], where)
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"{where}: 'enum' must be a non-empty list")
            return "(" + " | ".join(_value_literal(v, where) for v in values) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = schema[key]
                if not isinstance(alts, list) or not alts:
                    raise ValueError(f"{where}: {key!r} must be a non-empty list of schemas")
                return "(" + " | ".join(self.visit(s, f"{hint}-{i}", f"{where}.{key}[{i}]")
                                        for i, s in enumerate(alts)) + ")"
        if "allOf" in schema:
            return self.visit(self.merge(schema, where), hint, where)
        types = schema.get("type")
        if isinstance(types, list):
            if not types or not all(isinstance(t, str) for t in types):
                raise ValueError(f"{where}: 'type' must be a type name or a list of them")
            return "(" + " | ".join(self.visit({**schema, "type": t}, f"{hint}-{t}", where) for t in types) + ")"
        if types is None:
            if "properties" in schema or "additionalProperties" in schema:
                types = "object"
            elif "items" in schema or "prefixItems" in schema:
                types = "array"
            else:
                return self.use("value")
        if types not in _TYPES:
            raise ValueError(f"{where}: unrecognized type {types!r}" if isinstance(types, str)
                             else f"{where}: 'type' must be a type name or a list of them")
        return getattr(self, "type_" + types)(schema, hint, where)

    def ref(self, ref: Any, where: str) -> str:
        if ref not in self.refs:
            definition = self.definition(ref, where)
            name = ref.rpartition("/")[2]
            rule = self.add("ref-" + name, "")  # named first: the definition may refer to itself
            self.refs[ref] = rule
            self.rules[rule] = self._grow(self.visit(definition, "ref-" + name, ref))
        return self.refs[ref]

    def definition(self, ref: Any, where: str) -> Any:
        """The schema a local ``$ref`` names; ValueError for another reference or a missing definition."""
        if not isinstance(ref, str) or not ref.startswith(("#/definitions/", "#/$defs/")):
            raise ValueError(f"{where}: only local references (#/definitions/..., #/$defs/...) are supported")
        section, _, name = ref[2:].partition("/")
        defs = self.root.get(section) if isinstance(self.root, Mapping) else None
        if not isinstance(defs, Mapping) or name not in defs:
            raise ValueError(f"{where}: {ref!r} names no definition")
        return defs[name]

    def merge(self, schema: Mapping[str, Any], where: str) -> dict[str, Any]:
        """allOf of object schemas as one object schema (properties and required joined)."""
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise ValueError(f"{where}: 'allOf' must be a non-empty list of schemas")
        props: dict[str, Any] = {}
        required: list[str] = []
        for i, part in enumerate([schema, *parts]):
            at = where if i == 0 else f"{where}.allOf[{i - 1}]"
            if i and isinstance(part, Mapping) and "$ref" in part:
                part = self.definition(part["$ref"], at)
            if i and (not isinstance(part, Mapping) or set(part) - {"type", "properties", "required"} - _ANNOTATIONS
                      or part.get("type", "object") != "object"):
                raise ValueError(f"{at}: only object schemas with properties can be combined")
            p, r = part.get("properties") or {}, part.get("required") or []
            if not isinstance(p, Mapping) or not isinstance(r, list) or not all(isinstance(x, str) for x in r):
                raise ValueError(f"{at}: 'properties' must be an object and 'required' a list of names")
            props.update(p)
            required += [x for x in r if x not in required]
        return {"type": "object", "properties": props, "required": required}

    def type_object(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        props = schema.get("properties") or {}
        required = schema.get("required") or []
        if not isinstance(props, Mapping) or not isinstance(required, list) or \
                not all(isinstance(r, str) for r in required):
            raise ValueError(f"{where}: 'properties' must be an object and 'required' a list of names")
        missing = [r for r in required if r not in props]
        if missing:
            raise ValueError(f"{where}: required property {missing[0]!r} is not among the properties")
        self.use("space")
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return '"{" space "}" space'
            value = self.visit(extra, hint + "-value", where + ".additionalProperties")
            kv = self.add(hint + "-kv", f'{self.use("string")} ":" space {value}')
            return f'"{{" space ({kv} ("," space {kv})*)? "}}" space'
        keys = list(props)
        kvs = [self.add(f"{hint}-{k}-kv", f'{_literal(json.dumps(k, ensure_ascii=False))} space ":" space '
                                          f'{self.visit(props[k], f"{hint}-{k}", f"{where}.properties.{k}")}')
               for k in keys]
        # rest[i][first]: the members from keys[i] on, ``first`` when none was written yet (no comma)
        names = {(i, first): self.add(f"{hint}-rest-{i}-{int(first)}", "")
                 for i in range(len(keys)) for first in (True, False)}
        for i in range(len(keys) - 1, -1, -1):
            for first in (True, False):
                after = names.get((i + 1, False), "")
                skip = names.get((i + 1, first), "")
                this = ("" if first else '"," space ') + kvs[i] + (" " + after if after else "")
                if keys[i] in required:
                    body = this
                else:  # written, or skipped (then what follows is still first or not)
                    body = f"({this}) | {skip}" if skip else f"({this})?"
                self.rules[names[(i, first)]] = self._grow(body)
        return f'"{{" space {names[(0, True)]} "}}" space'

    def type_array(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        self.use("space")
        items = schema.get("prefixItems", schema.get("items"))
        if isinstance(items, list):  # a tuple: these items, in order
            parts = [self.visit(s, f"{hint}-{i}", f"{where}.items[{i}]") for i, s in enumerate(items)]
            inner = ' "," space '.join(parts)
            return f'"[" space {inner} "]" space' if parts else '"[" space "]" space'
        item = self.visit(items if items is not None else True, hint + "-item", where + ".items")
        lo, hi = self.bounds(schema, "minItems", "maxItems", where)
        if hi == 0:
            return '"[" space "]" space'
        rest = f'("," space {item})' + (f"{{{max(lo - 1, 0)},{hi - 1}}}" if hi is not None else
                                        f"{{{max(lo - 1, 0)},}}" if lo > 1 else "*")
        body = f"{item} {rest}"
        return f'"[" space {body} "]" space' if lo >= 1 else f'"[" space ({body})? "]" space'

    def type_string(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        if "pattern" in schema:
            raise ValueError(f"{where}: 'pattern' is not supported")
        lo, hi = self.bounds(schema, "minLength", "maxLength", where)
        if lo == 0 and hi is None:
            return self.use("string")
        self.use("char")
        self.use("space")
        reps = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}"
        return f'"\\"" char{reps} "\\"" space'

    def type_integer(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        minimum = schema.get("minimum")
        if minimum is None:
            return self.use("integer")
        if minimum == 0 and not isinstance(minimum, bool):
            return self.use("unsigned-integer")
        raise ValueError(f"{where}: 'minimum' other than 0 is not supported")

    def type_number(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        if "minimum" in schema:
            raise ValueError(f"{where}: 'minimum' is not supported on numbers")
        return self.use("number")

    def type_boolean(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        return self.use("boolean")

    def type_null(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        return self.use("null")

    @staticmethod
    def bounds(schema: Mapping[str, Any], lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
        lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_REPEAT):
                raise ValueError(f"{where}: {key!r} must be an integer in [0, {_MAX_REPEAT}]")
        if hi is not None and hi < lo:
            raise ValueError(f"{where}: {hi_key!r} is less than {lo_key!r}")
        return lo, hi


def json_schema_to_grammar(schema: Any, max_chars: int | None = None) -> str:
    """A GBNF grammar (root rule ``root``) accepting exactly JSON documents valid under ``schema`` (within
    the supported keywords, see the module); ValueError naming what cannot be converted, or, with
    ``max_chars``, a grammar that would grow past it (refused while it is built: a few hundred bytes of
    schema can ask for an exponentially large grammar)."""
    c = _Converter(schema, max_chars)
    root = c.visit(schema, "root", "schema")
    lines = [f"root ::= {root}"] + [f"{name} ::= {body}" for name, body in c.rules.items()]
    return "\n".join(lines) + "\n"
