package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
	"distill/model"
	"distill/train/testcache"
)

// TestInitTrainMoE: `student init --arch qwen3_moe` writes a Qwen3-MoE
// checkpoint with the MoE flags applied; `student train` trains it with
// NVFP4 QAD from a cache another (dense) teacher filled with the same
// tokenizer; `student export` writes BF16 (which the teacher code loads
// and scores with) and NVFP4; a Qwen3-MoE student also fine-tunes
// straight from a dataset (SFT, no teacher); MoE flags with a dense
// --arch are refused.
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
quant: nvfp4
calib_batches: 1
`), 0o644)
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", y, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	m, err := os.ReadFile(filepath.Join(run, "metrics.jsonl"))
	if err != nil || !strings.Contains(string(m), `"expert_share":[`) || !strings.Contains(string(m), `"aux_loss":`) {
		t.Fatalf("metrics.jsonl without the MoE metrics (%v):\n%s", err, m)
	}
	bf, fp4 := filepath.Join(dir, "bf16"), filepath.Join(dir, "nvfp4")
	if err := runExport([]string{"--checkpoint", run, "--out", bf}); err != nil {
		t.Fatal(err)
	}
	if err := runExport([]string{"--checkpoint", run, "--out", fp4, "--format", "nvfp4"}); err != nil {
		t.Fatal(err)
	}
	hq, err := os.ReadFile(filepath.Join(fp4, "hf_quant_config.json"))
	if err != nil || !strings.Contains(string(hq), "model.layers.1.mlp.gate") {
		t.Fatalf("hf_quant_config.json should exclude the routers (%v):\n%s", err, hq)
	}
	tm, err := infer.Load(bf, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	rd, _ := cache.OpenReader(b.CacheDir)
	smp, _ := rd.Get(3)
	res, err := tm.TopK([][]int32{smp.Tokens}, infer.Options{K: 97})
	if err != nil {
		t.Fatal(err)
	}
	var z float64
	for _, lp := range res[0].LogProbs[:97] {
		z += math.Exp(float64(lp))
	}
	if math.Abs(z-1) > 1e-4 {
		t.Fatalf("exported MoE model's probabilities sum to %g", z)
	}

	// SFT from a dataset (byte tokenizer, vocab 257).
	tok := filepath.Join(dir, "tok")
	os.MkdirAll(tok, 0o755)
	writeByteTokenizer(t, tok)
	file := filepath.Join(dir, "sft.jsonl")
	var recs strings.Builder
	for i := 0; i < 30; i++ {
		fmt.Fprintf(&recs, "{\"prompt\": \"What is %d plus %d?\", \"response\": \"%d.\"}\n", i, 2*i, 3*i)
	}
	os.WriteFile(file, []byte(recs.String()), 0o644)
	sft := filepath.Join(dir, "sft.yaml")
	os.WriteFile(sft, []byte(`run_dir: unused
model:
  random: {arch: qwen3_moe, vocab_size: 257, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128,
           num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 16, mlp_only_layers: []}
  tokenizer: `+tok+`
data: {dataset: {files: [nowhere.jsonl]}, seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 3, threads: 2}
log: {progress: "off"}
`), 0o644)
	srun := filepath.Join(dir, "sft-run")
	if err := runTrain([]string{"--config", sft, "--run-dir", srun, "--dataset", file}); err != nil {
		t.Fatal(err)
	}
	m, err = os.ReadFile(filepath.Join(srun, "metrics.jsonl"))
	if err != nil || strings.Count(string(m), `"expert_share_by_layer":[[`) != 3 {
		t.Fatalf("SFT metrics.jsonl: want 3 steps with both layers' expert shares (%v):\n%s", err, m)
	}

	err = runInit([]string{"--arch", "qwen3", "--out", filepath.Join(dir, "dense"), "--experts", "4"})
	if err == nil || !strings.Contains(err.Error(), "--experts") || !strings.Contains(err.Error(), "qwen3_moe") {
		t.Fatalf("--experts with --arch qwen3: %v", err)
	}
}
