// Package chattmpl renders the Jinja chat templates of Hugging Face
// tokenizers (the "chat_template" of tokenizer_config.json) byte-for-byte as
// transformers' apply_chat_template(tokenize=False) does.
//
// # Semantics reproduced
//
// transformers compiles the template with
//
//	ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//	    extensions=[AssistantTracker, jinja2.ext.loopcontrols])
//
// overrides the tojson filter with json.dumps(x, ensure_ascii=False,
// indent=None, separators=None, sort_keys=False), adds the globals
// raise_exception(msg) and strftime_now(fmt), and renders with
// messages, tools, documents, add_generation_prompt, the tokenizer's special
// tokens (bos_token, eos_token, ... only those that are set) and any extra
// keyword arguments (enable_thinking, date_string, ...). This package is an
// independent interpreter for the subset of jinja2 that chat templates use:
//
//   - whitespace control exactly as jinja2's lexer: trim_blocks,
//     lstrip_blocks, {%- -%} {{- -}} {#- -#}, {%+ +%}, newline normalization
//     and the dropped trailing newline;
//   - statements: if/elif/else, for (with else, "if" filter, tuple unpacking,
//     the loop object, break/continue), set (including ns.attr and block
//     set), macro, with, filter blocks, raw, and transformers' generation
//     block (rendered as its body; RenderSpans reports where it went);
//   - expressions with Python semantics: int/float arithmetic (/ is true
//     division, // and % floor), string/list concatenation and repetition,
//     chained comparisons, in / not in, and/or returning operands, inline
//     if/else, slicing with negative steps, attribute and item lookup with
//     jinja2's fallbacks, Undefined that prints as "" but fails when used;
//   - the str, dict and list methods templates call (split, strip, startswith,
//     items, get, ...), jinja2's filters (trim, length, join, map, select,
//     selectattr, dictsort, default, ...) and tests (defined, none, string,
//     mapping, sameas, ...);
//   - Python's str() of values: None, True, 1.0, 1e+16, ['a', "it's"],
//     {'k': 1}, (1,).
//
// Everything else is rejected with an error naming the construct and the
// template line: at compile time for unknown tags, filters and tests, at
// render time for type errors (adding a str to an int, calling an undefined
// name, ...). Errors wrap ErrSyntax, ErrUnsupported, ErrRender, ErrRaised or
// ErrInput.
//
// # Values
//
// Template variables are Go values converted once on entry: nil, bool,
// integers (int64 inside), floats, strings, slices, map[string]any (keys
// sorted, since Go maps have no order), *Dict (insertion ordered, like
// Python dicts) and Tuple. Use ParseJSON to turn JSON (tool calls, tool
// schemas) into values whose key order matches what Python would see; key
// order is visible in tojson output. Python ints are unbounded; here
// integers are 64-bit and overflow is an error.
//
// # Known differences from jinja2
//
// Recursive for loops, {% call %} blocks, *args/**kwargs in calls, template
// inheritance and includes are not supported (compile-time ErrUnsupported).
// range() returns a lazily printed range like Python but is materialized when
// iterated. String methods take only the argument forms listed in their
// errors.
//
// # Verification
//
// testdata/jinja_ref.py renders with Python's jinja2 in transformers'
// environment. testdata/golden.json (7 templates x 25 conversations:
// Qwen3, Qwen2.5, Llama 3, 3.1, 3.2, a {% generation %} variant and a
// synthetic construct-heavy template) is regenerated with
// "/usr/bin/python3 testdata/jinja_ref.py golden"; the live tests call the
// same script on freshly generated templates (expressions, whitespace-control
// fuzz, random conversations).
package chattmpl
