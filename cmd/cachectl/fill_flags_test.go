package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"distill/cache"
	"distill/data/tokenizer"
)

// TestFillSharesDatasetFlagsWithTokenize: fill takes the dataset flags
// tokenize takes (--columns, --roles, --skip-bad, --format among them,
// which fill lacked although its errors asked for them), and with the same
// flags both see the same dataset: tokenize's fingerprint is the cache's,
// and the cached tokens are tokenize's ids, empty rows included. Both
// commands reject bad values with the same message.
func TestFillSharesDatasetFlagsWithTokenize(t *testing.T) {
	needQwen3(t)
	tok, err := tokenizer.Load(qwen3Dir)
	if err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	// ShareGPT fields and roles, in a file whose extension says nothing,
	// with one bad record (an unknown role) to skip.
	dpath := filepath.Join(tmp, "sharegpt.txt")
	os.WriteFile(dpath, []byte(`{"conversations":[{"from":"human","value":"What is 2+2?"},{"from":"gpt","value":"4"}]}
{"conversations":[{"from":"robot","value":"beep"}]}
{"conversations":[{"from":"system","value":"Be brief."},{"from":"human","value":"Name a colour."},{"from":"gpt","value":"Blue."}]}
`), 0o644)
	dflags := []string{"--data", dpath, "--format", "jsonl", "--columns", "messages=conversations,role=from,content=value",
		"--roles", "human=user,gpt=assistant", "--skip-bad", "--template-var", "enable_thinking=false"}

	lines, stderr, err := runTok(t, append([]string{"--tokenizer", qwen3Dir}, dflags...)...)
	if err != nil {
		t.Fatalf("tokenize: %v\n%s", err, stderr)
	}
	m := regexp.MustCompile(`dataset fingerprint ([0-9a-f]{64})`).FindStringSubmatch(stderr)
	if m == nil || len(lines) != 3 || lines[1].Status != "skipped" {
		t.Fatalf("tokenize: %+v\n%s", lines, stderr)
	}

	mdir := fillModel(t, tok.VocabSize())
	cdir := filepath.Join(tmp, "cache")
	out, err := runFill(t, append([]string{"--model", mdir, "--tokenizer", qwen3Dir, "--cache", cdir, "--k", "4"}, dflags...)...)
	if err != nil {
		t.Fatalf("fill: %v\n%s", err, out)
	}
	if !strings.Contains(out, "1 bad records skipped") || !strings.Contains(out, "unknown role") || !strings.Contains(out, "sharegpt.txt:2") {
		t.Errorf("fill does not report the skipped record with its reason and line:\n%s", out)
	}
	r, err := cache.OpenReader(cdir)
	if err != nil {
		t.Fatal(err)
	}
	if fp := r.Manifest().DatasetFingerprint; fp != m[1] {
		t.Errorf("the cache's dataset fingerprint %s is not tokenize's %s for the same flags", fp, m[1])
	}
	for i, l := range lines {
		got, err := r.Get(int64(i))
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(got.Tokens) != fmt.Sprint(l.IDs) || fmt.Sprint(maskInts(got.Mask)) != fmt.Sprint(l.Mask) {
			t.Errorf("sample %d: cached %v %v, tokenize %v %v", i, got.Tokens, got.Mask, l.IDs, l.Mask)
		}
	}

	// The same bad values fail both commands alike, before any work.
	for _, bad := range [][]string{
		{"--format", "xml"},
		{"--columns", "body=text"},
		{"--roles", "human"},
		{"--roles", "human=usr"},
		{"--policy", "cut"},
		{"--max-len", "-1"},
		{"--num-samples", "-3"},
		{"--weights", "1,2"},
		{"--weights", "-1"},
		{"--template-var", "enable_thinking"},
		{"--data", dpath + ","},
	} {
		args := append(append([]string{}, dflags...), bad...)
		_, _, terr := runTok(t, append([]string{"--tokenizer", qwen3Dir}, args...)...)
		_, ferr := runFill(t, append([]string{"--model", mdir, "--cache", filepath.Join(tmp, "never")}, args...)...)
		if terr == nil || ferr == nil || terr.Error() != ferr.Error() || !strings.Contains(terr.Error(), bad[0]) {
			t.Errorf("%q: tokenize says %v; fill says %v", bad, terr, ferr)
		}
	}
	if _, err := os.Stat(filepath.Join(tmp, "never")); !os.IsNotExist(err) {
		t.Errorf("a fill refused for its flags created its cache: %v", err)
	}

	// Every dataset flag is in both commands' help, described alike
	// (--data says whose paths they are).
	var want flag.FlagSet
	(&datasetFlags{}).register(&want, "")
	var fh, th bytes.Buffer
	fillMain(context.Background(), []string{"-h"}, &fh, &fh)
	tokenizeMain([]string{"-h"}, &th, &th)
	want.VisitAll(func(f *flag.Flag) {
		block := func(help string) string {
			i := strings.Index(help, "  -"+f.Name+" ")
			if i < 0 {
				i = strings.Index(help, "  -"+f.Name+"\n")
			}
			if i < 0 {
				return ""
			}
			j := strings.Index(help[i+3:], "\n  -")
			if j < 0 {
				return help[i:]
			}
			return help[i : i+3+j]
		}
		fb, tb := strings.TrimSpace(block(fh.String())), strings.TrimSpace(block(th.String()))
		if fb == "" || tb == "" || (f.Name != "data" && fb != tb) {
			t.Errorf("flag --%s: fill help %q, tokenize help %q", f.Name, fb, tb)
		}
	})
}
