package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/model"
	"distill/train/testcache"
)

// TestInitTrainMoE: `student init --arch qwen3_moe` writes a Qwen3-MoE
// checkpoint with the MoE flags applied, and `student train` trains it
// from a cache another (dense) teacher filled with the same tokenizer;
// MoE flags with a dense --arch are refused.
func TestInitTrainMoE(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 40, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 4})
	if err != nil {
		t.Fatal(err)
	}
	ckpt := filepath.Join(dir, "moe")
	if err := runInit([]string{"--arch", "qwen3_moe", "--out", ckpt, "--vocab", "97", "--hidden", "32", "--layers", "2", "--heads", "2",
		"--kv-heads", "1", "--head-dim", "16", "--experts", "4", "--experts-per-tok", "2", "--moe-intermediate", "16",
		"--mlp-only-layers", "none", "--norm-topk-prob", "false", "--output-router-logits", "true", "--router-aux-loss-coef", "0.02"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := model.LoadConfig(ckpt)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NumExperts != 4 || cfg.ExpertsPerTok != 2 || cfg.MoEIntermediate != 16 || !cfg.IsMoE(0) || !cfg.IsMoE(1) ||
		cfg.NormTopKProb || !cfg.OutputRouterLogits || cfg.RouterAuxLossCoef != 0.02 {
		t.Fatalf("init wrote %+v", cfg)
	}
	y := filepath.Join(dir, "run.yaml")
	os.WriteFile(y, []byte(`run_dir: unused
model:
  init_from: `+ckpt+`
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [nowhere], seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 4, threads: 2}
checkpoint: {every: 2}
log: {progress: "off"}
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", y, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	m, err := os.ReadFile(filepath.Join(run, "metrics.jsonl"))
	if err != nil || !strings.Contains(string(m), `"expert_share":[`) || !strings.Contains(string(m), `"aux_loss":`) {
		t.Fatalf("metrics.jsonl without the MoE metrics (%v):\n%s", err, m)
	}
	err = runInit([]string{"--arch", "qwen3", "--out", filepath.Join(dir, "dense"), "--experts", "4"})
	if err == nil || !strings.Contains(err.Error(), "--experts") || !strings.Contains(err.Error(), "qwen3_moe") {
		t.Fatalf("--experts with --arch qwen3: %v", err)
	}
}
