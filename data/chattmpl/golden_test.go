package chattmpl

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The goldens in testdata/golden.json were rendered by Python's jinja2 with
// transformers' environment (testdata/jinja_ref.py golden, run with
// /usr/bin/python3 and python3-jinja2). Regenerate them after changing
// corpus.json or a template.

type goldenCase struct {
	Out   *string `json:"out"`
	Error string  `json:"error"`
	Msg   string  `json:"msg"`
}

func loadCorpus(t testing.TB) (*Dict, map[string]goldenCase) {
	t.Helper()
	raw, err := os.ReadFile("testdata/corpus.json")
	if err != nil {
		t.Fatal(err)
	}
	v, err := ParseJSON(raw)
	if err != nil {
		t.Fatalf("corpus.json: %v", err)
	}
	graw, err := os.ReadFile("testdata/golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Cases map[string]goldenCase `json:"cases"`
	}
	if err := json.Unmarshal(graw, &g); err != nil {
		t.Fatalf("golden.json: %v", err)
	}
	return v.(*Dict), g.Cases
}

func dget(d *Dict, k string) any {
	v, _ := d.Get(k)
	return v
}

func loadTemplate(t testing.TB, file string) *Template {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("testdata", "templates", file))
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := Compile(string(src))
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return tmpl
}

// convOptions turns a corpus conversation into Render options.
func convOptions(t testing.TB, conv, tcfg *Dict, now time.Time) ([]Message, Options) {
	msgs, err := MessagesFromValue(dget(conv, "messages"))
	if err != nil {
		t.Fatal(err)
	}
	opts := Options{Now: now, Extra: map[string]any{}}
	if v, ok := dget(conv, "add_generation_prompt").(bool); ok {
		opts.AddGenerationPrompt = v
	}
	if tools, ok := dget(conv, "tools").([]any); ok {
		opts.Tools = tools
	}
	st, _ := dget(tcfg, "special_tokens").(*Dict)
	for i, k := range st.Keys() {
		switch k {
		case "bos_token":
			opts.BOSToken = st.vals[i].(string)
		case "eos_token":
			opts.EOSToken = st.vals[i].(string)
		default:
			opts.Extra[k.(string)] = st.vals[i]
		}
	}
	if extra, ok := dget(conv, "extra").(*Dict); ok {
		for i, k := range extra.Keys() {
			opts.Extra[k.(string)] = extra.vals[i]
		}
	}
	return msgs, opts
}

// TestGoldenJinja2 renders every corpus conversation with every template and
// compares byte-for-byte with jinja2's output (or checks that both fail).
func TestGoldenJinja2(t *testing.T) {
	corpus, golden := loadCorpus(t)
	now, _ := time.Parse("2006-01-02T15:04:05", dget(corpus, "now").(string))
	templates := dget(corpus, "templates").(*Dict)
	convs := dget(corpus, "conversations").([]any)
	n := 0
	for i, tn := range templates.Keys() {
		tcfg := templates.vals[i].(*Dict)
		tmpl := loadTemplate(t, dget(tcfg, "file").(string))
		for _, c := range convs {
			conv := c.(*Dict)
			key := tn.(string) + "/" + dget(conv, "name").(string)
			want, ok := golden[key]
			if !ok {
				t.Errorf("%s: no golden; rerun testdata/jinja_ref.py golden", key)
				continue
			}
			n++
			msgs, opts := convOptions(t, conv, tcfg, now)
			got, err := tmpl.Render(msgs, opts)
			checkAgainst(t, key, want, got, err)
		}
	}
	if n < 100 {
		t.Fatalf("only %d golden cases ran; corpus or golden.json is truncated", n)
	}
}

func checkAgainst(t *testing.T, key string, want goldenCase, got string, err error) {
	t.Helper()
	if want.Out == nil {
		if err == nil {
			t.Errorf("%s: jinja2 failed with %s: %s, but chattmpl rendered %q", key, want.Error, want.Msg, got)
			return
		}
		if want.Error == "TemplateError" {
			// raise_exception: the message must come through verbatim.
			var e *Error
			if !errors.As(err, &e) || !errors.Is(err, ErrRaised) || e.Msg != want.Msg {
				t.Errorf("%s: want raise_exception(%q), got %v", key, want.Msg, err)
			}
		} else if !errors.Is(err, ErrRender) {
			t.Errorf("%s: want a render error (jinja2: %s: %s), got %v", key, want.Error, want.Msg, err)
		}
		return
	}
	if err != nil {
		t.Errorf("%s: unexpected error: %v\nwant %q", key, err, *want.Out)
		return
	}
	if got != *want.Out {
		t.Errorf("%s: mismatch at byte %d\n got: %q\nwant: %q", key, firstDiff(got, *want.Out), got, *want.Out)
	}
}

func firstDiff(a, b string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestGoldenFixedStrings pins a few outputs that are known from the model
// cards, independent of both renderers, so a bad golden regeneration is caught.
func TestGoldenFixedStrings(t *testing.T) {
	_, golden := loadCorpus(t)
	want := map[string]string{
		"qwen3/enable_thinking_false": "<|im_start|>user\nBe quick.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
		"llama3/basic_gen":            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
		"qwen2_5/single_user_no_gen":  "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\njust one<|im_end|>\n",
		"llama3_2/date_string":        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 01 Jan 2030\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat day is it?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
	}
	for k, w := range want {
		g, ok := golden[k]
		if !ok || g.Out == nil || *g.Out != w {
			t.Errorf("golden %s drifted from the model-card string %q", k, w)
		}
	}
	if !strings.Contains(*golden["qwen3/think_inline"].Out, "<|im_start|>assistant\nanswer one<|im_end|>") {
		t.Errorf("qwen3/think_inline: earlier-turn reasoning should be dropped")
	}
}

// TestGenerationSpansGolden: on a Qwen2.5 variant with {% generation %}
// around assistant replies, the spans cover exactly "<reply><|im_end|>" of
// every tool-free assistant turn of the jinja2-rendered text.
func TestGenerationSpansGolden(t *testing.T) {
	corpus, golden := loadCorpus(t)
	templates := dget(corpus, "templates").(*Dict)
	tcfg := dget(templates, "qwen2_5_generation").(*Dict)
	tmpl := loadTemplate(t, "qwen2_5_generation.jinja")
	checked := 0
	for _, c := range dget(corpus, "conversations").([]any) {
		conv := c.(*Dict)
		key := "qwen2_5_generation/" + dget(conv, "name").(string)
		want := golden[key]
		if want.Out == nil {
			continue
		}
		msgs, opts := convOptions(t, conv, tcfg, time.Time{})
		out, spans, err := tmpl.RenderSpans(msgs, opts)
		if err != nil || out != *want.Out {
			t.Errorf("%s: render differs from jinja2 (%v)", key, err)
			continue
		}
		var wantSpans []string
		for _, m := range msgs {
			if m.Role == "assistant" && len(m.ToolCalls) == 0 {
				wantSpans = append(wantSpans, m.Content+"<|im_end|>")
			}
		}
		if len(spans) != len(wantSpans) {
			t.Errorf("%s: %d spans, want %d", key, len(spans), len(wantSpans))
			continue
		}
		for i, s := range spans {
			if out[s.Start:s.End] != wantSpans[i] || out[s.Start-len("<|im_start|>assistant\n"):s.Start] != "<|im_start|>assistant\n" {
				t.Errorf("%s: span %d = %q, want %q", key, i, out[s.Start:s.End], wantSpans[i])
			}
		}
		checked += len(spans)
	}
	if checked < 10 {
		t.Fatalf("only %d spans checked", checked)
	}
}
