#!/usr/bin/env python3
"""Structured output and tool calls through the official `openai` client against a running
`tessera serve` (crates/cli/tests/serve.rs runs this): every output is validated with the
`jsonschema` package, and one JSON object of what was seen is printed for the Rust test.

  python tools/serve/structured_client.py BASE_URL MODEL
"""
import json
import sys

import jsonschema
import openai

base, model = sys.argv[1:3]
client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                               "minItems": 1, "maxItems": 3}},
                   "required": ["colors"], "additionalProperties": False},
    "const_bounds": {"type": "object", "properties": {"kind": {"const": "city"},
                                                      "population": {"type": "integer", "minimum": 1000, "maximum": 50000000},
                                                      "area_km2": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}},
                     "required": ["kind", "population", "area_km2"], "additionalProperties": False},
    "lengths_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                         "title": {"type": "string", "minLength": 3, "maxLength": 12},
                                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                                  "maxItems": 2}},
                        "required": ["code", "title", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
        "active": {"type": "boolean"}},
        "required": ["person", "active"], "additionalProperties": False},
    "one_of_null": {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                          {"type": "null"}]}},
                    "required": ["answer"], "additionalProperties": False},
}
PROMPT = "Reply with a JSON object about a fictional town and its mayor."

out = {"schemas": {}, "errors": {}, "tools": {}}


def validate(text, schema):
    """None when `text` is JSON valid under `schema`, else why not."""
    try:
        jsonschema.validate(json.loads(text), schema)
        return None
    except Exception as e:  # noqa: BLE001 - the message is the report
        return f"{type(e).__name__}: {str(e)[:300]}"


for name, schema in SCHEMAS.items():
    results = []
    for temperature, seed, stream in [(0, 0, False), (1, 1, False), (1, 2, True), (1, 3, False)]:
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        kwargs = dict(model=model, messages=[{"role": "user", "content": PROMPT}], temperature=temperature, seed=seed,
                      max_tokens=160, response_format=fmt)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        results.append({"temperature": temperature, "stream": stream, "finish": finish, "text": text,
                        "invalid": validate(text, schema)})
    out["schemas"][name] = results

r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Any JSON object, please."}],
                                   temperature=1, seed=5, max_tokens=100, response_format={"type": "json_object"})
out["json_object"] = {"text": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                      "is_object": isinstance(json.loads(r.choices[0].message.content), dict)}

# The legacy completions endpoint takes a schema too.
t = client.completions.create(model=model, prompt="A JSON object: ", temperature=0, max_tokens=80,
                              extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMAS["object"]}}})
out["completion"] = {"text": t.choices[0].text, "invalid": validate(t.choices[0].text, SCHEMAS["object"])}

for name, fmt in [
    ("unsupported_keyword", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}}}),
    ("bad_type", {"type": "yaml"}),
    ("schema_not_object", {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}),
]:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], response_format=fmt)
        out["errors"][name] = None
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        out["errors"][name] = {"status": e.status_code, "param": body.get("param"), "message": body.get("message")}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a timezone",
                                      "parameters": {"type": "object", "properties": {
                                          "timezone": {"type": "string", "pattern": "^[A-Za-z]+/[A-Za-z_]+$"}},
                                          "required": ["timezone"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_calls(calls):
    """Each call's function exists and its arguments validate."""
    problems = []
    for c in calls:
        if c["name"] not in PARAMS:
            problems.append(f"unknown function {c['name']}")
            continue
        why = validate(c["arguments"], PARAMS[c["name"]])
        if why:
            problems.append(f"{c['name']}: {why}")
    return problems


MARKERS = ["<tool_call>", "</tool_call>", "tool_call"]
for name, choice, stream, parallel in [
    ("required", "required", False, True),
    ("required_stream", "required", True, True),
    ("named", {"type": "function", "function": {"name": "get_time"}}, False, False),
    ("named_stream", {"type": "function", "function": {"name": "get_time"}}, True, False),
    ("auto", "auto", False, True),
    ("none", "none", False, True),
]:
    kwargs = dict(model=model, messages=ASK, temperature=0, max_tokens=120, tools=TOOLS, tool_choice=choice,
                  parallel_tool_calls=parallel)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                e = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                e["id"] = d.id or e["id"]
                e["name"] += (d.function.name or "") if d.function else ""
                e["arguments"] += (d.function.arguments or "") if d.function else ""
        calls = [calls[i] for i in sorted(calls)]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        content, finish = m.content or "", r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in (m.tool_calls or [])]
    out["tools"][name] = {"calls": calls, "content": content, "finish": finish, "problems": check_calls(calls),
                          "marker_in_content": any(k in content for k in MARKERS)}

# A tool result goes back through the template: the model answers in text.
call = out["tools"]["required"]["calls"][0]
history = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function",
                                                          "function": {"name": call["name"], "arguments": call["arguments"]}}]},
    {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, clear sky"},
]
r = client.chat.completions.create(model=model, messages=history, temperature=0, max_tokens=40, tools=TOOLS, tool_choice="none")
out["tools"]["round_trip"] = {"content": r.choices[0].message.content, "finish": r.choices[0].finish_reason,
                              "calls": len(r.choices[0].message.tool_calls or [])}
try:
    client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    out["errors"]["unknown_tool"] = None
except openai.APIStatusError as e:
    body = e.body if isinstance(e.body, dict) else {}
    out["errors"]["unknown_tool"] = {"status": e.status_code, "param": body.get("param")}
print(json.dumps(out))
