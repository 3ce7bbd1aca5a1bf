package train

import (
	"fmt"
	"math/rand"
	"testing"

	"distill/compute/device"
	"distill/model"
	"distill/train/loss"
)

// BenchmarkTrainStep is one KD training step (forward, fused LM-head loss
// with k = 64, backward; no optimizer) of a ~20M-parameter Qwen3-shaped
// student on one packed row of 1024 tokens (4 samples). It reports
// tokens/s and the achieved GFLOP/s counting 6·params_matmul·tokens plus
// the attention matmuls (4 per layer: QKᵀ and PV forward, twice that back,
// over the causal half) and the extra LM-head recompute of the tiled loss.
//
//	go test ./train -run '^$' -bench TrainStep -benchtime 3x
func BenchmarkTrainStep(b *testing.B) {
	cfg := &model.Config{Arch: model.ArchQwen3, VocabSize: 32000, Hidden: 256, Layers: 8, Heads: 4, KVHeads: 2, HeadDim: 64,
		Intermediate: 1024, MaxPositions: 4096, RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true}
	benchTrainStep(b, cfg)
}

// BenchmarkTrainStepMoE is BenchmarkTrainStep with every MLP a Qwen3-MoE
// block of 8 experts, top-2, 512 wide (so the active MLP width, 2x512,
// equals the dense student's 1024), norm_topk_prob, and the
// load-balancing loss on (router_aux_loss_coef 0.001). GFLOP/s counts the
// active parameters (the router and the 2 chosen experts per token).
// train/testdata/bench_torch_moe.py is the same step in PyTorch, with HF's
// Qwen3MoeSparseMoeBlock (eager: per expert, index the tokens, index_add
// back); scripts/bench-train-cpu.sh runs both.
//
//	go test ./train -run '^$' -bench TrainStepMoE -benchtime 3x
func BenchmarkTrainStepMoE(b *testing.B) {
	cfg := &model.Config{Arch: model.ArchQwen3MoE, VocabSize: 32000, Hidden: 256, Layers: 8, Heads: 4, KVHeads: 2, HeadDim: 64,
		Intermediate: 1024, MaxPositions: 4096, RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true,
		NumExperts: 8, ExpertsPerTok: 2, MoEIntermediate: 512, DecoderSparseStep: 1, NormTopKProb: true,
		OutputRouterLogits: true, RouterAuxLossCoef: 0.001}
	benchTrainStep(b, cfg)
}

func benchTrainStep(b *testing.B, cfg *model.Config) {
	s, err := NewStudent(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 1})); err != nil {
		b.Fatal(err)
	}
	const N, K = 1024, 64
	rng := rand.New(rand.NewSource(1))
	bt := &Batch{Tokens: make([]int32, N), Starts: []int32{0, 300, 500, 900, N}, Mask: make([]uint8, N), K: K,
		TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for t := 0; t < N; t++ {
		bt.Tokens[t] = int32(rng.Intn(cfg.VocabSize))
		bt.Mask[t] = 1
		perm := rng.Perm(cfg.VocabSize)[:K]
		for j := 0; j < K; j++ {
			bt.TopIDs[t*K+j] = int32(perm[j])
			bt.TopLP[t*K+j] = float32(-2 - j)
		}
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	var params int64
	for _, t := range s.Tensors {
		params += int64(t.N)
	}
	C, V := int64(cfg.Hidden), int64(cfg.VocabSize)
	matmulParams := params - V*C // the embedding lookup is not a matmul; the head is counted below
	if cfg.TieEmbeddings {
		matmulParams += V * C
	}
	for i := 0; i < cfg.Layers; i++ {
		if cfg.IsMoE(i) { // only the top-k experts run for a token
			matmulParams -= int64(cfg.NumExperts-cfg.ExpertsPerTok) * 3 * C * int64(cfg.MoEIntermediate)
		}
	}
	flops := 6*float64(matmulParams)*N + 2*float64(V*C)*N // + the recomputed head logits
	var att float64
	for s := 0; s+1 < len(bt.Starts); s++ {
		l := float64(bt.Starts[s+1] - bt.Starts[s])
		att += l * l / 2
	}
	flops += float64(cfg.Layers) * 2 * 2 * att * float64(cfg.Heads*cfg.HeadDim) * 3
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s.ZeroGrad()
		if _, err := s.ForwardBackward(bt, &opt, 0); err != nil {
			b.Fatal(err)
		}
	}
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(N/sec, "tokens/s")
	b.ReportMetric(flops/sec/1e9, "GFLOP/s")
	b.ReportMetric(float64(params)/1e6, "Mparams")
}

// BenchmarkLoRAStep is BenchmarkTrainStep's step (the same student shape
// and row) for a LoRA student, rank 16 on every module, without and with
// lora_dropout 0.1: the dropout's cost is the difference (its masks
// drawn twice, forward and backward, over every adapter's input).
//
//	go test ./train -run '^$' -bench LoRAStep -benchtime 3x
func BenchmarkLoRAStep(b *testing.B) {
	cfg := &model.Config{Arch: model.ArchQwen3, VocabSize: 32000, Hidden: 256, Layers: 8, Heads: 4, KVHeads: 2, HeadDim: 64,
		Intermediate: 1024, MaxPositions: 4096, RMSNormEps: 1e-6, RopeTheta: 1e6, QKNorm: true}
	w := model.Init(cfg, model.InitOptions{Seed: 1})
	const N, K = 1024, 64
	rng := rand.New(rand.NewSource(1))
	bt := &Batch{Tokens: make([]int32, N), Starts: []int32{0, 300, 500, 900, N}, Mask: make([]uint8, N), K: K,
		TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for t := 0; t < N; t++ {
		bt.Tokens[t] = int32(rng.Intn(cfg.VocabSize))
		bt.Mask[t] = 1
		perm := rng.Perm(cfg.VocabSize)[:K]
		for j := 0; j < K; j++ {
			bt.TopIDs[t*K+j] = int32(perm[j])
			bt.TopLP[t*K+j] = float32(-2 - j)
		}
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	for _, p := range []float64{0, 0.1} {
		b.Run(fmt.Sprintf("dropout=%g", p), func(b *testing.B) {
			s, err := NewLoRAStudentOn(cfg, device.CPU(0), mapSource(w), LoRAConfig{Rank: 16, Alpha: 32, Targets: allTargets, Init: "kaiming", Dropout: p})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Free()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				s.ZeroGrad()
				s.SetStepRow(i+1, 0)
				if _, err := s.ForwardBackward(bt, &opt, 0); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(N/(b.Elapsed().Seconds()/float64(b.N)), "tokens/s")
		})
	}
}
