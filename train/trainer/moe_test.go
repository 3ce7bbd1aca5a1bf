package trainer

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"testing"

	"distill/model"
	"distill/train/testcache"
)

func moeConfig(t *testing.T, b *testcache.Built, runDir string, over ...string) *Config {
	y := fmt.Sprintf(`run_dir: %s
seed: 3
model:
  random: {arch: qwen3_moe, vocab_size: 97, hidden_size: 32, num_hidden_layers: 3, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 8, intermediate_size: 64, max_position_embeddings: 256, init_seed: 1,
           num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 32, mlp_only_layers: [1],
           output_router_logits: true, router_aux_loss_coef: 0.01}
  tokenizer_fingerprint: testcache-tokenizer
data:
  cache: [%s]
  seq_len: 64
  global_batch_tokens: 150
  eval_range: [0, 16]
distill: {kd_loss: fwd_kl, tail: bucket, kd_weight: 1, sft_weight: 0.1}
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: cosine, warmup_steps: 2, max_grad_norm: 1}
train: {max_steps: 10, threads: 2}
eval: {every: 5}
checkpoint: {every: 4, keep: 2}
log: {every: 4, progress: "off"}
`, runDir, b.CacheDir)
	p := filepath.Join(t.TempDir(), "cfg.yaml")
	if err := os.WriteFile(p, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(p, over)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestMoERun: a random Qwen3-MoE student (4 experts, top-2, layers 0 and 2
// sparse, the load-balancing loss on) trains from a teacher's cache: the
// loss and the held-out KD fall, metrics.jsonl logs the aux loss and the
// per-expert token shares (pooled and per MoE layer, each summing to 1),
// the loss includes router_aux_loss_coef·aux, a resume is bit-identical,
// and the final checkpoint is a qwen3_moe HF checkpoint with the experts'
// tensors.
func TestMoERun(t *testing.T) {
	b := testCache(t)
	dir := filepath.Join(t.TempDir(), "full")
	full, err := Run(moeConfig(t, b, dir), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if ls := losses(full); len(ls) != 10 || !(ls[9] < ls[0]) {
		t.Fatalf("training loss did not fall: %v", ls)
	}
	if !(full.Evals[1].KD < full.Evals[0].KD) {
		t.Fatalf("eval kd %g -> %g", full.Evals[0].KD, full.Evals[1].KD)
	}
	f, err := os.Open(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		if m["type"] != "train" {
			continue
		}
		n++
		aux, _ := m["aux_loss"].(float64)
		// top-2 of 4: a perfectly balanced router gives 2, a collapsed
		// one up to 4.
		if !(aux >= 1.5 && aux <= 4) {
			t.Fatalf("step %v: aux_loss %v", m["step"], m["aux_loss"])
		}
		share, _ := m["expert_share"].([]any)
		layers, _ := m["expert_share_by_layer"].([]any)
		if len(share) != 4 || len(layers) != 2 {
			t.Fatalf("step %v: expert_share %v, by layer %v: want 4 experts, 2 MoE layers", m["step"], m["expert_share"], m["expert_share_by_layer"])
		}
		for _, sh := range append([]any{share}, layers...) {
			var sum float64
			for _, v := range sh.([]any) {
				sum += v.(float64)
			}
			if math.Abs(sum-1) > 1e-9 {
				t.Fatalf("step %v: shares %v sum to %v", m["step"], sh, sum)
			}
		}
	}
	if n != 10 {
		t.Fatalf("%d train lines in metrics.jsonl, want 10", n)
	}
	// With the aux loss off, step 1 (same weights, same data) differs by
	// exactly coef·aux.
	off, err := Run(moeConfig(t, b, filepath.Join(t.TempDir(), "off"), "train.max_steps=1", "optim.warmup_steps=0", "eval.every=0", "model.random.output_router_logits=false"), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	s1, o1 := full.Steps[0], off.Steps[0]
	if d := s1.Loss - o1.Loss; math.Abs(d-0.01*s1.AuxLoss) > 1e-9 || s1.AuxLoss != o1.AuxLoss {
		t.Fatalf("step 1 loss %.10g with aux, %.10g without: difference %.3g, want 0.01 x aux %.6g", s1.Loss, o1.Loss, d, s1.AuxLoss)
	}

	rdir := filepath.Join(t.TempDir(), "resumed")
	if _, err := Run(moeConfig(t, b, rdir), Options{Log: io.Discard, StopAfter: 5}); err != nil {
		t.Fatal(err)
	}
	rest, err := Run(moeConfig(t, b, rdir), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range rest.Steps {
		if w := full.Steps[s.Step-1]; s.Loss != w.Loss || s.GradNorm != w.GradNorm || s.AuxLoss != w.AuxLoss {
			t.Fatalf("step %d after resume: loss %.17g, uninterrupted %.17g", s.Step, s.Loss, w.Loss)
		}
	}
	// NVFP4 QAD of the MoE student (experts and attention quantized):
	// step 1 differs from the unquantized run on the same data, and the
	// checkpoint holds every quantizer's amax (2 MoE layers of 4 experts:
	// 4+12+4 each, the dense layer 11).
	qdir := filepath.Join(t.TempDir(), "qad")
	qad, err := Run(moeConfig(t, b, qdir, "quant=nvfp4", "calib_batches=2", "train.max_steps=4", "eval.every=0"), Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	if qad.Steps[0].Loss == full.Steps[0].Loss || qad.Steps[0].Tokens != full.Steps[0].Tokens || !(qad.Steps[3].Loss < qad.Steps[0].Loss) {
		t.Fatalf("QAD steps %+v vs plain step 1 %+v", qad.Steps, full.Steps[0])
	}
	var st State
	sb, _ := os.ReadFile(filepath.Join(checkpointDir(qdir, 4), "state.json"))
	if err := json.Unmarshal(sb, &st); err != nil || len(st.QuantAmax) != 2*20+11 {
		t.Fatalf("state.json: %v, %d amax values", err, len(st.QuantAmax))
	}

	cfg, err := model.LoadConfig(full.Checkpoint)
	if err != nil || cfg.Arch != model.ArchQwen3MoE || cfg.NumExperts != 4 || !cfg.IsMoE(2) || cfg.IsMoE(1) {
		t.Fatalf("final checkpoint config %+v: %v", cfg, err)
	}
}
