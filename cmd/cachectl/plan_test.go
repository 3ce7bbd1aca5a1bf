package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"distill/internal/cli"
)

// TestPlan: cachectl plan reads a config.json (or its directory) and no
// weights, prints each GPU's layers, weights and largest forward, and the
// budget; a model that does not fit says what to change; bad flags are
// errors naming them.
func TestPlan(t *testing.T) {
	dir := t.TempDir()
	writeQwen3_8B(t, dir)
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		planOut = &out
		defer func() { planOut = os.Stdout }()
		err := runPlan(args)
		return out.String(), err
	}
	out, err := run("--config", dir, "--device-memory", "80GiB")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", out)
	for _, want := range []string{"teacher plan: qwen3, 8.19B parameters (36 layers", "1 GPU(s) of 80.00 GiB (ordinals 0)",
		"embedding, layers 0-35, norm, LM head  15.26 GiB", "token budget: up to "} {
		if !strings.Contains(out, want) {
			t.Errorf("the plan lacks %q", want)
		}
	}
	for _, devs := range [][]string{{"--gpus", "2"}, {"--devices", "2"}, {"--devices", "3,5"}} {
		out, err = run(append([]string{"--config", filepath.Join(dir, "config.json"), "--device-memory", "24GiB", "--weights", "fp8"}, devs...)...)
		if err != nil {
			t.Fatal(err)
		}
		first, last := "0", "1"
		if devs[1] == "3,5" {
			first, last = "3", "5"
		}
		if !regexp.MustCompile(`(?m)^`+first+` +embedding, layers 0-\d+ `).MatchString(out) || !regexp.MustCompile(`(?m)^`+last+` +layers \d+-35, norm, LM head `).MatchString(out) ||
			!strings.Contains(out, "fp8: the layers' Linear weights in E4M3") || !strings.Contains(out, "LM head stay BF16") {
			t.Errorf("%v, fp8:\n%s", devs, out)
		}
	}
	out, err = run("--config", dir, "--device-memory", "12GiB")
	if err == nil || !strings.Contains(err.Error(), "GPU 0 (embedding, layers 0-35, norm, LM head): its 15.26 GiB weights exceed") || !strings.Contains(out, "does not fit:") {
		t.Errorf("a 12 GiB GPU: %v\n%s", err, out)
	}
	out, err = run("--config", dir, "--devices", "0,1", "--token-budget", "4000000")
	if err == nil || !strings.Contains(err.Error(), "GPU 0 (embedding, layers 0-") || !strings.Contains(err.Error(), "lower --token-budget to") {
		t.Errorf("a budget too large: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--config is required"},
		// A path that does not exist said only "want a config.json".
		{[]string{"--config", filepath.Join(dir, "nope.json")}, filepath.Join(dir, "nope.json") + " does not exist: check the path (want a config.json"},
		{[]string{"--config", filepath.Join(dir, "nodir")}, filepath.Join(dir, "nodir") + " does not exist: check the path"},
		{[]string{"--config", filepath.Join(dir, "nodir", "config.json")}, "checkpoint directory " + filepath.Join(dir, "nodir") + " does not exist"},
		{[]string{"--config", dir, "--device-memory", "lots"}, "--device-memory"},
		{[]string{"--config", dir, "--devices", "0"}, "--devices 0: want a count of at least 1"},
		{[]string{"--config", dir, "--devices", "a,b"}, `--devices "a,b"`},
		{[]string{"--config", dir, "--devices", "1,0,1"}, `--devices "1,0,1" names GPU 1 twice`}, // it planned GPU 1 twice, each with the whole memory
		{[]string{"--config", dir, "--devices", "2", "--gpus", "2"}, "not both"},
		{[]string{"--config", dir, "--devices", "37"}, "37 GPUs for 36 layers"},
		{[]string{"--config", dir, "--weights", "int4"}, `weights "int4"`},
		{[]string{"--config", dir, "--k", "0"}, "--k 0"},
		// More top-k ids than the vocabulary holds was planned as given
		// (exit 0); teacherd refuses such a --k-max at start.
		{[]string{"--config", dir, "--k", "151937"}, "--k 151937 is more than the teacher's vocabulary (151936, the vocab_size of " + dir + "): "},
	} {
		out, err := run(c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %q", c.args, err, c.want)
		}
		if c.args != nil && c.args[len(c.args)-2] == "--k" && (cli.ExitStatus(err) != 2 || out != "") {
			t.Errorf("%v: exit status %d, want 2 (a usage error, as --k 0), and no plan:\n%s", c.args, cli.ExitStatus(err), out)
		}
	}
	if _, err := run("--config", dir, "--k", "151936"); err != nil {
		t.Errorf("--k equal to the vocabulary: %v", err)
	}
}

// writeQwen3_8B writes Qwen3-8B's config.json into dir.
func writeQwen3_8B(t *testing.T, dir string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
		"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
		"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
		"tie_word_embeddings": false}`), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestPlanCapsMaxLen: a --max-len above max_position_embeddings is capped
// at it with a one-line note, as teacherd caps a sample (before, the plan
// silently planned memory for samples the teacher never serves).
func TestPlanCapsMaxLen(t *testing.T) {
	dir := t.TempDir()
	writeQwen3_8B(t, dir)
	run := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		planOut = &out
		defer func() { planOut = os.Stdout }()
		if err := runPlan(append([]string{"--config", dir}, args...)); err != nil {
			t.Fatalf("plan %v: %v\n%s", args, err, out.String())
		}
		return out.String()
	}
	capped, plain := run("--max-len", "100000"), run()
	note, rest, _ := strings.Cut(capped, "\n")
	if note != "note: --max-len 100000 is more than max_position_embeddings 40960 of "+dir+": planning samples of at most 40960 tokens, as teacherd does" {
		t.Errorf("first line of a plan with --max-len above max_position_embeddings: %q", note)
	}
	if rest != plain {
		t.Errorf("plan with --max-len 100000:\n%s\nwant the plan at max_position_embeddings:\n%s", rest, plain)
	}
	if out := run("--max-len", "40960"); strings.Contains(out, "note:") {
		t.Errorf("--max-len at max_position_embeddings printed a note:\n%s", out)
	}
}
