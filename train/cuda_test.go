package train

import (
	"fmt"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/train/loss"
	"distill/train/optim"
)

// TestCUDAQADExport: a student trained with NVFP4 QAD on the CUDA backend
// (the CPU emulator of CUDA here, the GPU under DISTILL_CUDA_TEST=gpu)
// exports NVFP4 weights that decode to the device's fake-quantized weights
// bit for bit, for every Linear: the device's FakeQuantNVFP4 and the
// export packer share compute's scalar definitions. For a dense Qwen3 and
// a Qwen3-MoE student (every expert's Linears quantized, their inputs in
// the MoE kernels); quantization must change the loss.
func TestCUDAQADExport(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	for _, cfg := range []*model.Config{tinyConfig(model.ArchQwen3, false), tinyMoEConfig(false, 1)} {
		t.Run(string(cfg.Arch), func(t *testing.T) { cudaQADExport(t, be, cfg) })
	}
}

func cudaQADExport(t *testing.T, be *cuda.Backend, cfg *model.Config) {
	s, err := NewStudentOn(cfg, be)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 1})); err != nil {
		t.Fatal(err)
	}
	b := testBatch(2, cfg.VocabSize, 8)
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	plain, err := s.Forward(b, &opt)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Forward(b, &opt); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	if q, err := s.Forward(b, &opt); err != nil || q.Loss == plain.Loss {
		t.Fatalf("QAD forward: loss %v (err %v), the same as unquantized: quantization is off", q.Loss, err)
	}
	ad, _ := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
	var first, last float64
	for step := 0; step < 6; step++ {
		s.ZeroGrad()
		st, err := s.ForwardBackward(b, &opt, 0)
		if err != nil {
			t.Fatal(err)
		}
		if step == 0 {
			first = st.Loss
		}
		last = st.Loss
		optim.ClipGradNorm(s.Groups(), 1)
		ad.Step(3e-3)
	}
	if !(last < first) {
		t.Fatalf("QAD on cuda: loss %g -> %g", first, last)
	}
	packed, _, err := s.ExportNVFP4()
	if err != nil {
		t.Fatal(err)
	}
	s.Model.QuantizeWeights()
	n := 0
	for i := range s.Model.Blocks {
		for _, l := range s.Model.Blocks[i].Linears() {
			d := packed[l.Name].Dequantize()
			wfq := make([]float32, l.Out*l.In)
			be.ReadF32(l.Wfq, wfq)
			for j := range d {
				if d[j] != wfq[j] {
					t.Fatalf("%s[%d]: export decodes to %g, the device's fake quant is %g", l.Name, j, d[j], wfq[j])
				}
			}
			n++
		}
	}
	t.Logf("%d Linears: the NVFP4 export equals the device's fake-quantized weights bit for bit", n)
}

// TestCUDAShardedOverlap: a 4-layer student sharded at ZeRO stages 2 and
// 3 (over a group of one), with and without NVFP4 QAD, trains three
// steps of four rows on the CUDA backend with Sharding.Overlap, its
// collectives (NCCL's) and their kernels on the backend's second stream, and ends
// with the same bits as without overlap. On the emulator, whose
// stream-order checks fail any kernel, copy or collective that touches
// what the other stream uses with no event between them, it also checks
// the overlap's ordering: the gradient buffers' reuse, the prefetched
// weight slots, the step's wait before the clip.
func TestCUDAShardedOverlap(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := deepConfig(4)
	rows := []*Batch{testBatch(11, 97, 8), testBatch(12, 97, 8), testBatch(13, 97, 8), testBatch(14, 97, 8)}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	total := 0.0
	for _, b := range rows {
		for _, m := range b.Mask {
			total += float64(m)
		}
	}
	for _, stage := range []int{2, 3} {
		for _, qad := range []bool{false, true} {
			t.Run(fmt.Sprintf("zero%d/qad=%v", stage, qad), func(t *testing.T) {
				run := func(overlap bool) map[string][]float32 {
					c := ncclOfOne(t, be)
					defer c.Close()
					s, err := NewShardedStudentOn(cfg, be, Sharding{C: c, Stage: stage, Overlap: overlap})
					if err != nil {
						t.Fatal(err)
					}
					defer s.Free()
					if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 5})); err != nil {
						t.Fatal(err)
					}
					shardSteps(t, s, shardCase{cfg: cfg, qad: qad}, rows, func(int) bool { return true }, &opt, total, func(x float64) float64 { return x })
					return s.Weights()
				}
				want, got := run(false), run(true)
				for name, w := range want {
					for j := range w {
						if got[name][j] != w[j] {
							t.Fatalf("%s[%d] = %g with overlap, %g without", name, j, got[name][j], w[j])
						}
					}
				}
			})
		}
	}
}

// TestCUDABucketedAllReduce: a 4-layer student, unsharded (data parallel
// at ZeRO 0 and 1), accumulates two rows' gradients with the last row's
// backward armed (ReduceInBackward: each block's gradients all-reduced in
// a bucket beside the blocks' backwards that follow) over an NCCL group
// of one (the emulator's stand-in), and after AllReduceGrads holds the
// same gradients, bit for bit, as the same student reduced in one
// all-reduce after the backward; three steps, so the buckets come round.
// On the emulator the stream-order checks see the buckets' copies and
// all-reduces against the backward.
func TestCUDABucketedAllReduce(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := deepConfig(4)
	rows := []*Batch{testBatch(11, 97, 8), testBatch(12, 97, 8)}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	c := ncclOfOne(t, be)
	defer c.Close()
	run := func(buckets bool) [][]float32 {
		s, err := NewStudentOn(cfg, be)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Free()
		if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 5})); err != nil {
			t.Fatal(err)
		}
		ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
		if err != nil {
			t.Fatal(err)
		}
		defer ad.Free()
		var grads [][]float32
		for step := 0; step < 3; step++ {
			s.ZeroGrad()
			for i, b := range rows {
				if buckets && i == len(rows)-1 {
					s.ReduceInBackward(c)
				}
				if _, err := s.ForwardBackward(b, &opt, 40); err != nil {
					t.Fatal(err)
				}
			}
			s.AllReduceGrads(c)
			g := make([]float32, s.grads.Len())
			be.ReadF32(s.grads, g)
			grads = append(grads, g)
			ad.Step(3e-3)
		}
		return grads
	}
	want, got := run(false), run(true)
	for step := range want {
		for j := range want[step] {
			if got[step][j] != want[step][j] {
				t.Fatalf("step %d: gradient %d = %g with buckets, %g without", step+1, j, got[step][j], want[step][j])
			}
		}
	}
}

// ncclOfOne is an NCCL group of one rank on be (on the emulator, NCCL's
// stand-in): its collectives run on the stream, as on a GPU (a host
// group's would synchronize the host, hiding a missing event).
func ncclOfOne(t *testing.T, be *cuda.Backend) compute.Collective {
	t.Helper()
	id, err := be.NewCollectiveID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := be.JoinCollective(id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
