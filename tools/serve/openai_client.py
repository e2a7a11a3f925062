#!/usr/bin/env python3
"""The official `openai` client against a running `tessera serve` (crates/cli/tests/serve.rs runs
this), and /metrics through prometheus_client's parser: prints one JSON object of what it saw,
which the Rust test checks.

  python tools/serve/openai_client.py BASE_URL MODEL API_KEY
"""
import json
import sys

import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

base, model, key = sys.argv[1:4]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
out = {"version": openai.__version__}
messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]

out["models"] = [m.id for m in client.models.list().data]
r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=20)
out["chat"] = {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason,
               "usage": [r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens],
               "cached": r.usage.prompt_tokens_details.cached_tokens}

chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=20, stream=True,
                                             stream_options={"include_usage": True}))
out["stream"] = {"content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                 "finish_reason": [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
                 "usage_chunks": [[c.usage.prompt_tokens, c.usage.completion_tokens] for c in chunks if c.usage],
                 "empty_choices": sum(1 for c in chunks if not c.choices)}

# Two choices with log-probabilities, through the client's own types; the prompt was seen
# twice above, so the prefix cache serves it.
r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6, n=2, logprobs=True, top_logprobs=2)
out["choices"] = {"contents": [c.message.content for c in r.choices], "indexes": [c.index for c in r.choices],
                  "tokens": [[t.token for t in c.logprobs.content] for c in r.choices],
                  "top": [[[a.token for a in t.top_logprobs] for t in c.logprobs.content] for c in r.choices],
                  "logprobs": [[t.logprob for t in c.logprobs.content] for c in r.choices],
                  "cached": r.usage.prompt_tokens_details.cached_tokens, "prompt_tokens": r.usage.prompt_tokens}

t = client.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=8)
out["completion"] = {"text": t.choices[0].text, "finish_reason": t.choices[0].finish_reason}

errors = {}
for name, call in [
    ("unknown_model", lambda: client.chat.completions.create(model="nope", messages=messages)),
    ("bad_temperature", lambda: client.chat.completions.create(model=model, messages=messages, temperature=5)),
    ("wrong_key", lambda: openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()),
]:
    try:
        call()
        errors[name] = None
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        errors[name] = {"status": e.status_code, "class": type(e).__name__, "param": body.get("param"), "code": body.get("code")}
out["errors"] = errors

text = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics").read().decode()
families = {f.name: {"type": f.type, "samples": {s.name + json.dumps(s.labels, sort_keys=True): s.value for s in f.samples}}
            for f in text_string_to_metric_families(text)}
out["metrics"] = families
print(json.dumps(out))
