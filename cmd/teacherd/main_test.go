package main

import (
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"distill/model"
	"distill/serve"
)

func TestParseConfigFlagsOverrideYAML(t *testing.T) {
	p := filepath.Join(t.TempDir(), "t.yaml")
	os.WriteFile(p, []byte("model: /m\nlisten: 0.0.0.0:1\ncache: /c\ntoken_budget: 512\ndrain_timeout: 5s\nk_max: 100\n"), 0o644)
	cfg, _, _, err := parseConfig([]string{"--config", p, "--listen", "127.0.0.1:2", "--k-max", "7"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Model != "/m" || cfg.Cache != "/c" || cfg.TokenBudget != 512 || cfg.DrainTimeout != 5*time.Second {
		t.Errorf("file values lost: %+v", cfg)
	}
	if cfg.Listen != "127.0.0.1:2" || cfg.KMax != 7 {
		t.Errorf("flags did not override the file: %+v", cfg)
	}
	os.WriteFile(p, []byte("model: /m\ntokenbudget: 3\n"), 0o644)
	if _, _, _, err := parseConfig([]string{"--config", p}); err == nil || !strings.Contains(err.Error(), "unknown key tokenbudget (did you mean token_budget?)") {
		t.Errorf("unknown key: %v", err)
	}
	// --device cuda without a driver (forced, on any machine): an error
	// naming the missing library, before the daemon serves.
	m := tinyModelDir(t)
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
	if err := run([]string{"--model", m, "--device", "cuda", "--listen", "127.0.0.1:0", "--metrics", "off"}); err == nil || !strings.Contains(err.Error(), "DISTILL_LIBCUDA") {
		t.Errorf("--device cuda without a driver: %v", err)
	}
	if err := run([]string{"--model", m, "--device", "tpu"}); err == nil || !strings.Contains(err.Error(), "want auto, cpu or cuda") {
		t.Errorf("--device tpu: %v", err)
	}
	if err := run([]string{"--listen", "127.0.0.1:0"}); err == nil || !strings.Contains(err.Error(), "no model") {
		t.Errorf("no model: %v", err)
	}
}

// TestSecurityFlags: --data-root repeats and replaces the file's
// data_roots, --insecure is read from both, and the daemon refuses at
// startup what it cannot serve safely: --cache naming a file, a listen
// address beyond loopback without auth.
func TestSecurityFlags(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.yaml")
	os.WriteFile(p, []byte("model: /m\ndata_roots: [/a, /b]\ninsecure: true\n"), 0o644)
	cfg, _, _, err := parseConfig([]string{"--config", p})
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.DataRoots) != 2 || cfg.DataRoots[1] != "/b" || !cfg.Insecure {
		t.Errorf("file values lost: %+v", cfg)
	}
	cfg, _, _, err = parseConfig([]string{"--config", p, "--data-root", "/c", "--data-root", "/d", "--insecure=false"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(cfg.DataRoots, ",") != "/c,/d" || cfg.Insecure {
		t.Errorf("flags did not override the file: %+v", cfg)
	}

	file := filepath.Join(dir, "cache")
	os.WriteFile(file, []byte("x"), 0o644)
	m := tinyModelDir(t)
	if err := run([]string{"--model", m, "--cache", file, "--listen", "127.0.0.1:0", "--metrics", "off"}); err == nil || !strings.Contains(err.Error(), "is a file, not a directory") {
		t.Errorf("--cache FILE: %v", err)
	}
	if err := run([]string{"--model", m, "--listen", "0.0.0.0:0", "--metrics", "off"}); err == nil || !strings.Contains(err.Error(), "--insecure") {
		t.Errorf("--listen 0.0.0.0 without auth: %v", err)
	}
	if err := run([]string{"--model", m, "--data-root", file, "--listen", "127.0.0.1:0", "--metrics", "off"}); err == nil || !strings.Contains(err.Error(), "is not a directory") {
		t.Errorf("--data-root FILE: %v", err)
	}
}

// TestExampleConfigDocumentsEveryKey: examples/teacherd.yaml loads, and
// every yaml key of serve.Config appears in it, so the reference cannot
// fall behind the daemon.
func TestExampleConfigDocumentsEveryKey(t *testing.T) {
	p := "../../examples/teacherd.yaml"
	cfg, err := serve.LoadConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Model == "" || len(cfg.DataRoots) == 0 || cfg.Listen != "127.0.0.1:7070" {
		t.Errorf("example values not read: %+v", cfg)
	}
	text, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	typ := reflect.TypeOf(serve.Config{})
	for i := 0; i < typ.NumField(); i++ {
		key, _, _ := strings.Cut(typ.Field(i).Tag.Get("yaml"), ",")
		if key == "" || key == "-" {
			continue
		}
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + `:`).Match(text) {
			t.Errorf("%s does not document the key %q", p, key)
		}
	}
}

// tinyModelDir writes a small random checkpoint (a model teacherd loads).
func tinyModelDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 64, 32, 1, 64, 64
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 1}), "BF16"); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestConfigErrorsBeforeListening: a --model that is not a checkpoint
// fails before the port is bound (the taken port below would fail
// otherwise); it and a --k-max the model cannot give name the flag, as a
// configuration error rather than "invalid request".
func TestConfigErrorsBeforeListening(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	missing := filepath.Join(t.TempDir(), "nosuchmodel")
	err = run([]string{"--model", missing, "--listen", l.Addr().String(), "--metrics", "off"})
	if err == nil || !strings.Contains(err.Error(), "--model "+missing) || strings.Contains(err.Error(), "listen") || strings.Contains(err.Error(), "invalid request") {
		t.Errorf("--model nosuchmodel with the port taken: %v", err)
	}
	err = run([]string{"--model", tinyModelDir(t), "--k-max", "100", "--listen", "127.0.0.1:0", "--metrics", "off", "--device", "cpu"})
	if err == nil || !strings.Contains(err.Error(), "--k-max 100: want 1 <= k-max <= 64 (the teacher's vocab size)") || strings.Contains(err.Error(), "invalid request") {
		t.Errorf("--k-max 100 on a vocab-64 model: %v", err)
	}
}

// TestPlanFlag: teacherd --plan prints the split of --model's config over
// --devices and each GPU's bytes without loading weights (the checkpoint
// dir needs only config.json) or listening, for the budget, k-max and
// draws the daemon would run with; a budget a GPU cannot hold is an error
// naming the GPU; --devices and --micro-batches override the YAML.
func TestPlanFlag(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
		"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
		"max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false, "hidden_act": "silu"}`), 0o644)
	var out strings.Builder
	cfg, _, pf, err := parseConfig([]string{"--plan", "--model", dir, "--devices", "2,3", "--device-memory", "80GiB", "--k-max", "64"})
	if err != nil {
		t.Fatal(err)
	}
	if err := printPlan(&out, cfg, pf); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"70.55B parameters", "top-k up to 64, samples up to 8192 tokens, up to 64 draws a position", "(ordinals 2,3)",
		"bytes at a forward of 8192 tokens (the token budget asked for)", "2    embedding, layers 0-39       65.71 GiB", "3    layers 40-79, norm, LM head  65.71 GiB", "token budget: up to "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the plan lacks %q:\n%s", want, out.String())
		}
	}
	cfg, _, pf, _ = parseConfig([]string{"--plan", "--model", dir, "--devices", "0,1", "--device-memory", "80GiB", "--token-budget", "200000"})
	out.Reset()
	if err := printPlan(&out, cfg, pf); err == nil || !strings.Contains(err.Error(), "GPU 0 (embedding, layers 0-39): a forward of 200000 tokens") {
		t.Errorf("a budget of 200000 tokens: %v", err)
	}
	cfg, _, pf, _ = parseConfig([]string{"--plan", "--model", dir, "--device-memory", "80GiB"})
	out.Reset()
	if err := printPlan(&out, cfg, pf); err == nil || !strings.Contains(err.Error(), "GPU 0 (embedding, layers 0-79, norm, LM head): its 131.42 GiB weights exceed") {
		t.Errorf("70B on one 80 GiB GPU: %v", err)
	}
	if _, _, _, err := parseConfig([]string{"--model", dir, "--device-memory", "80GiB"}); err == nil || !strings.Contains(err.Error(), "is for --plan") {
		t.Errorf("--device-memory without --plan: %v", err)
	}
	cfg, _, pf, _ = parseConfig([]string{"--plan", "--model", dir, "--device-memory", "141GiB", "--weights", "fp8"})
	out.Reset()
	if err := printPlan(&out, cfg, pf); err != nil || !strings.Contains(out.String(), "fp8 weights") || !strings.Contains(out.String(), "67.69 GiB") {
		t.Errorf("--plan --weights fp8: %v\n%s", err, out.String())
	}
	// A k-max above the vocabulary: the daemon refuses to start with it,
	// and the plan printed one for it and exited 0.
	cfg, _, pf, _ = parseConfig([]string{"--plan", "--model", dir, "--device-memory", "80GiB", "--k-max", "200000"})
	out.Reset()
	if err := printPlan(&out, cfg, pf); err == nil || !strings.Contains(err.Error(), "--k-max 200000: want 1 <= k-max <= 128256 (the teacher's vocab size)") || out.Len() != 0 {
		t.Errorf("--plan --k-max 200000 (vocab 128256): %v\n%s", err, out.String())
	}
	p := filepath.Join(t.TempDir(), "t.yaml")
	os.WriteFile(p, []byte("model: /m\ndevices: \"0,1\"\nmicro_batches: 4\n"), 0o644)
	cfg, _, _, err = parseConfig([]string{"--config", p, "--devices", "2,3"})
	if err != nil || cfg.Devices != "2,3" || cfg.MicroBatches != 4 {
		t.Errorf("--devices over the YAML's: %+v %v", cfg, err)
	}
	if err := run([]string{"--model", dir, "--devices", "0,x", "--listen", "127.0.0.1:0", "--metrics", "off"}); err == nil || !strings.Contains(err.Error(), `--devices "0,x"`) {
		t.Errorf("--devices 0,x: %v", err)
	}
}
