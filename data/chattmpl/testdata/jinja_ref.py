#!/usr/bin/python3
"""Reference renderer for data/chattmpl: renders chat templates with Python's
jinja2 in the environment transformers builds in
transformers.utils.chat_template_utils._compile_jinja_template:

    ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[<generation tag>, loopcontrols])
    filters["tojson"]    = json.dumps(x, ensure_ascii=False, indent=None,
                                      separators=None, sort_keys=False)
    globals["raise_exception"], globals["strftime_now"]

and renders with messages=, tools=, documents=, add_generation_prompt=, the
special tokens, and extra kwargs (apply_chat_template(tokenize=False)).

Usage:
  jinja_ref.py golden        regenerate testdata/golden.json from corpus.json
  jinja_ref.py batch         read [{"template": src, "vars": {...}, "now": iso}]
                             as JSON on stdin, write [{"out": s} | {"error":
                             type, "msg": m}] as JSON on stdout

Run with the Debian interpreter (/usr/bin/python3, package python3-jinja2).
Written for this project; it does not import transformers.
"""
import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))


class GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body (transformers'
    AssistantTracker does the same when no tracker is active)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(now):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(src, variables, now_iso):
    now = datetime.datetime.fromisoformat(now_iso or "2024-07-26T10:00:00")
    try:
        out = make_env(now).from_string(src).render(**variables)
        return {"out": out}
    except Exception as e:  # the Go side only checks that it errors too
        return {"error": type(e).__name__, "msg": str(e)}


def chat_vars(conv, tmpl_cfg):
    v = {
        "messages": conv["messages"],
        "tools": conv.get("tools"),
        "documents": None,
        "add_generation_prompt": conv.get("add_generation_prompt", False),
    }
    v.update(tmpl_cfg.get("special_tokens", {}))
    v.update(conv.get("extra", {}))
    return v


def golden():
    with open(os.path.join(HERE, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    out = {"jinja2_version": jinja2.__version__, "cases": {}}
    for tname, tcfg in corpus["templates"].items():
        with open(os.path.join(HERE, "templates", tcfg["file"]), encoding="utf-8") as f:
            src = f.read()
        for conv in corpus["conversations"]:
            if tname in conv.get("skip", []):
                continue
            key = tname + "/" + conv["name"]
            out["cases"][key] = render(src, chat_vars(conv, tcfg), corpus.get("now"))
    with open(os.path.join(HERE, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote %d cases" % len(out["cases"]))


def batch():
    reqs = json.load(sys.stdin)
    res = [render(r["template"], r.get("vars", {}), r.get("now")) for r in reqs]
    json.dump(res, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    {"golden": golden, "batch": batch}[sys.argv[1]]()
