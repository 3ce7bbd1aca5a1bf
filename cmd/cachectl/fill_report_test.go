package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFillReportsEmptySamples: fill prints how many samples were
// truncated, dropped or skipped, with reasons, and a fill in which every
// sample ended up without a target is an error (it printed "0 tokens" and
// exited 0).
func TestFillReportsEmptySamples(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	// Targets only after the first 4 tokens (a prompt of 4, then an answer).
	var lines []string
	for i := 0; i < 6; i++ {
		ids := make([]int32, 6+i)
		mask := make([]int, len(ids))
		for j := range ids {
			ids[j] = int32(1 + (i*7+j*3)%290)
			if j >= 4 {
				mask[j] = 1
			}
		}
		b, _ := json.Marshal(map[string]any{"input_ids": ids, "loss_mask": mask})
		lines = append(lines, string(b))
	}
	dpath := filepath.Join(tmp, "d.jsonl")
	os.WriteFile(dpath, []byte(strings.Join(lines, "\n")+"\n"), 0o644)

	// --max-len 4 leaves no sample a target.
	out, err := runFill(t, "--model", mdir, "--cache", filepath.Join(tmp, "c1"), "--data", dpath, "--pretokenized", "--max-len", "4", "--chunk", "4")
	if err == nil || !strings.Contains(err.Error(), "every one of the 6 samples filled is empty") || !strings.Contains(err.Error(), "6 dropped") ||
		!strings.Contains(err.Error(), "--max-len") {
		t.Fatalf("all samples empty: %v\n%s", err, out)
	}
	if !strings.Contains(out, "0 tokens, 0 targets") || !strings.Contains(out, "6  no target within max-len") || !strings.Contains(out, "e.g. "+dpath+":1: no target token within the first 4 of 6 tokens") {
		t.Errorf("all samples empty, output:\n%s", out)
	}

	// --max-len 7: samples 0 and 1 fit (2 and 3 targets), 2..5 are cut to 7 tokens (3 targets each).
	out, err = runFill(t, "--model", mdir, "--cache", filepath.Join(tmp, "c2"), "--data", dpath, "--pretokenized", "--max-len", "7", "--chunk", "4")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(out, "6 samples, 41 tokens, 17 targets") || !strings.Contains(out, "4 truncated to --max-len, 0 dropped, 0 bad records skipped") {
		t.Errorf("truncation counts:\n%s", out)
	}
	// --policy drop: the 4 long ones are dropped, and said so.
	out, err = runFill(t, "--model", mdir, "--cache", filepath.Join(tmp, "c3"), "--data", dpath, "--pretokenized", "--max-len", "7", "--policy", "drop")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(out, "6 samples, 13 tokens, 5 targets") || !strings.Contains(out, "0 truncated to --max-len, 4 dropped, 0 bad records skipped") ||
		!strings.Contains(out, "4  longer than max-len") {
		t.Errorf("drop counts:\n%s", out)
	}
}

// TestFillInProcessErrorsAreLocal: with --model, errors say what is wrong
// here (a flag to set, a file), never "the daemon", and a permanent error
// is not retried.
func TestFillInProcessErrorsAreLocal(t *testing.T) {
	mdir := fillModel(t, 300) // no tokenizer.json in it
	tmp := t.TempDir()
	ids := filepath.Join(tmp, "ids.jsonl")
	os.WriteFile(ids, []byte(`{"input_ids":[1,2,3,4]}`+"\n"), 0o644)
	long, _ := json.Marshal(map[string]any{"input_ids": make([]int, 600)})
	longPath := filepath.Join(tmp, "long.jsonl")
	os.WriteFile(longPath, append(long, '\n'), 0o644)
	text := filepath.Join(tmp, "text.jsonl")
	os.WriteFile(text, []byte(`{"text":"hello"}`+"\n"), 0o644)
	// A cache directory whose chunks/ is a file: the first commit fails.
	notDir := filepath.Join(tmp, "c0")
	os.MkdirAll(notDir, 0o755)
	os.WriteFile(filepath.Join(notDir, "chunks"), []byte("x"), 0o644)

	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--cache", notDir, "--data", ids, "--pretokenized"}, []string{"chunk [0, 1)", "not a directory"}},
		{[]string{"--cache", filepath.Join(tmp, "c1"), "--data", filepath.Join(tmp, "nope.jsonl"), "--pretokenized"}, []string{"nope.jsonl does not exist"}},
		{[]string{"--cache", filepath.Join(tmp, "c2"), "--data", text}, []string{"no tokenizer.json", "give --tokenizer DIR", "--pretokenized"}},
		{[]string{"--cache", filepath.Join(tmp, "c3"), "--data", longPath, "--pretokenized"}, []string{"600 tokens, more than the teacher's limit 512", "set --max-len"}},
	} {
		out, err := runFill(t, append([]string{"--model", mdir}, tc.args...)...)
		if err == nil {
			t.Errorf("%q: no error\n%s", tc.args, out)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q: %v; want %q in it", tc.args, err, w)
			}
		}
		for _, no := range []string{"daemon", "teacher in-process", "times", "Internal"} {
			if strings.Contains(err.Error(), no) {
				t.Errorf("%q: %v; should not say %q", tc.args, err, no)
			}
		}
	}
}
