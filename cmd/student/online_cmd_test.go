package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"distill/cache"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/serve"
)

// TestOnlineCUDACLI is online KD's user flow through the command on the
// emulated GPUs: a teacherd split over two of them (--devices 0,1) and
// `student train` with distill.teachers and train.device cuda, its
// answers written through to a lossless cache; the run exits 0, the write
// cache verifies, and a run from that cache trains bit for bit as the
// online one did (the promise of examples/train.yaml).
func TestOnlineCUDACLI(t *testing.T) {
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
	dir := t.TempDir()
	tok := filepath.Join(dir, "tok")
	os.MkdirAll(tok, 0o755)
	writeByteTokenizer(t, tok)
	mdir := filepath.Join(dir, "teacher")
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 260, 32, 2, 64, 256
	cfg.Heads, cfg.KVHeads, cfg.HeadDim = 4, 2, 8
	if err := model.WriteCheckpoint(mdir, cfg, model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "arith.jsonl")
	var recs strings.Builder
	for i := range 40 {
		a, b := (i*7)%50, (i*11)%40
		js, _ := json.Marshal(map[string]string{"prompt": fmt.Sprintf("What is %d plus %d?", a, b), "response": fmt.Sprintf("%d plus %d is %d.", a, b, a+b)})
		recs.Write(append(js, '\n'))
	}
	if err := os.WriteFile(data, []byte(recs.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := serve.Start(serve.Config{Model: mdir, Tokenizer: tok, Cache: filepath.Join(dir, "daemon-cache"), Listen: "127.0.0.1:0", Metrics: "off",
		Device: "cuda", Devices: "0,1", KMax: 16, DataRoots: []string{dir}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())

	const common = `seed: 3
model:
  random: {arch: qwen3, vocab_size: 260, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, max_position_embeddings: 256, init_seed: 1}
  tokenizer: %s
data:
%s  seq_len: 128
  global_batch_tokens: 256
  eval_range: [0, 8]
distill:
  kd_weight: 1
  sft_weight: 0.2
%soptim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2}
train: {max_steps: 6, device: cuda, threads: 1}
eval: {every: 3}
checkpoint: {every: 3}
log: {every: 1, progress: "off", tensorboard: false}
`
	wc := filepath.Join(dir, "write-cache")
	online := fmt.Sprintf(common, tok, fmt.Sprintf("  dataset:\n    files: [%s]\n", data),
		fmt.Sprintf("  teachers: [%s]\n  k: 4\n  chunk_samples: 8\n  prefetch: 8\n  teacher_timeout: 1m\n  write_cache: %s\n  write_encoding: lossless\n", d.Addr(), wc))
	offline := fmt.Sprintf(common, tok, fmt.Sprintf("  cache: [%s]\n", wc), "")
	train := func(name, conf string) string {
		t.Helper()
		cfgPath, run := filepath.Join(dir, name+".yaml"), filepath.Join(dir, name)
		if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		p := startStudent(t, "train", "--config", cfgPath, "--run-dir", run)
		if rc := p.wait(t); rc != 0 || !strings.Contains(p.stderr.String(), "done: step 6") {
			t.Fatalf("%s: exit status %d, want 0 and done at step 6:\n%s", name, rc, p.stderr.String())
		}
		return run
	}
	on := train("online", online)
	if rep, err := cache.Check(wc, nil); err != nil || !rep.OK() || rep.Samples == 0 {
		t.Fatalf("the write cache: %+v, %v", rep, err)
	}
	off := train("offline", offline)
	if a, b := trainLosses(t, on), trainLosses(t, off); len(a) != 6 || !slices.Equal(a, b) {
		t.Errorf("online losses %v, from its write cache %v: want the same 6", a, b)
	}
}
