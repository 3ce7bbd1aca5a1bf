package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestPlan: cachectl plan reads a config.json (or its directory) and no
// weights, prints each GPU's layers, weights and largest forward, and the
// budget; a model that does not fit says what to change; bad flags are
// errors naming them.
func TestPlan(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
		"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
		"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
		"tie_word_embeddings": false}`), 0o644)
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
	for _, want := range []string{"teacher plan: qwen3, 8.19B parameters (36 layers", "1 GPU(s) of 80.00 GiB",
		"embedding, 0-35, norm, LM head  15.26 GiB", "token budget: "} {
		if !strings.Contains(out, want) {
			t.Errorf("the plan lacks %q", want)
		}
	}
	out, err = run("--config", filepath.Join(dir, "config.json"), "--gpus", "2", "--device-memory", "24GiB", "--weights", "fp8")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^0 +embedding, 0-\d+ `).MatchString(out) || !regexp.MustCompile(`(?m)^1 +\d+-35, norm, LM head `).MatchString(out) ||
		!strings.Contains(out, "fp8: the layers' Linear weights in E4M3") || !strings.Contains(out, "several GPUs: a plan on paper only") {
		t.Errorf("2 GPUs, fp8:\n%s", out)
	}
	out, err = run("--config", dir, "--device-memory", "12GiB")
	if err != nil || !strings.Contains(out, "none: the weights exceed what the GPU offers by") || !strings.Contains(out, "does not fit:") {
		t.Errorf("a 12 GiB GPU: %v\n%s", err, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--config is required"},
		{[]string{"--config", filepath.Join(dir, "nope.json")}, "want a config.json"},
		{[]string{"--config", dir, "--device-memory", "lots"}, "--device-memory"},
		{[]string{"--config", dir, "--gpus", "0"}, "0 GPUs"},
		{[]string{"--config", dir, "--weights", "int4"}, `weights "int4"`},
		{[]string{"--config", dir, "--k", "0"}, "--k 0"},
	} {
		if _, err := run(c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %q", c.args, err, c.want)
		}
	}
}
