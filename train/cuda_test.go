package train

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
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
					s, err := NewShardedStudentOn(cfg, be, Sharding{C: c, Stage: stage, Overlap: overlap, FP32Gathers: qad})
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

// gatherLog is a Collective that records the all-gathers issued through
// it (each one's dtype and elements a rank) before running them.
type gatherLog struct {
	compute.Collective
	calls []gatherCall
}

type gatherCall struct {
	dt compute.DType
	n  int
}

func (g *gatherLog) AllGather(dst, src compute.Tensor, n int) {
	g.calls = append(g.calls, gatherCall{dst.DType(), n})
	g.Collective.AllGather(dst, src, n)
}

// bytes are the bytes the gathers of dtype dt moved into each rank.
func (g *gatherLog) bytes(dt compute.DType) int64 {
	var b int64
	for _, c := range g.calls {
		if c.dt == dt {
			b += int64(c.n) * int64(g.Size()) * int64(dt.Size())
		}
	}
	return b
}

// TestCUDAShardedBF16Gathers: at ZeRO stages 3 and 2 on the CUDA backend
// (over an NCCL group of one: the emulator's stand-in, its all-gather of
// ncclBfloat16 included) the blocks' GEMM weights are all-gathered as
// BF16 into BF16 whole weights (stage 3's slots, stage 2's own) the
// decoder binds as the Linears' weights, the norms, biases and routers
// kept whole in fp32, and three steps end with the weights (Weights: the
// fp32 masters) and gradient norms of the same student gathering fp32
// (Sharding.FP32Gathers) bit for bit, and the unsharded student's within
// 1e-6: a dense Qwen3 with and without overlap, a Qwen2 (biases) and a
// Qwen3-MoE (the router, the experts' grouped GEMMs). The log of the
// gathers shows it: with BF16 gathers every gather of a block is BF16 of
// the block's whole (padded) size and the fp32 ones are the units outside
// the blocks and one pack of the small tensors a step; with FP32Gathers
// there is no BF16 gather, and the BF16 bytes are half the fp32 bytes of
// the blocks' gathers they replace.
func TestCUDAShardedBF16Gathers(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	rows := []*Batch{testBatch(11, 97, 8), testBatch(12, 97, 8), testBatch(13, 97, 8), testBatch(14, 97, 8)}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	total := 0.0
	for _, b := range rows {
		for _, m := range b.Mask {
			total += float64(m)
		}
	}
	for _, c := range []struct {
		name    string
		cfg     *model.Config
		overlap bool
		stage   int
	}{
		{"zero3/qwen3-4layers", deepConfig(4), false, 3},
		{"zero3/qwen3-4layers-overlap", deepConfig(4), true, 3},
		{"zero3/qwen2-overlap", tinyConfig(model.ArchQwen2, false), true, 3},
		{"zero3/moe-overlap", tinyMoEConfig(false, 1), true, 3},
		{"zero2/qwen3-4layers-overlap", deepConfig(4), true, 2},
		{"zero2/qwen2", tinyConfig(model.ArchQwen2, false), false, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			type result struct {
				w     map[string][]float32
				norms []float64
				log   *gatherLog
				block []int // the blocks' units' parts (elements a rank)
				out   []int // the outside units' parts
				sper  int
			}
			run := func(fp32 bool) result {
				g := &gatherLog{Collective: ncclOfOne(t, be)}
				defer g.Close()
				s, err := NewShardedStudentOn(c.cfg, be, Sharding{C: g, Stage: c.stage, Overlap: c.overlap, FP32Gathers: fp32})
				if err != nil {
					t.Fatal(err)
				}
				defer s.Free()
				if err := s.Load(model.Init(c.cfg, model.InitOptions{Seed: 5})); err != nil {
					t.Fatal(err)
				}
				if s.sh.bf16 == fp32 {
					t.Fatalf("FP32Gathers %v: the student gathers BF16 %v", fp32, s.sh.bf16)
				}
				// What the decoder reads: the Linears' weights from the
				// slots (BF16 unless fp32), the norms in fp32.
				wantW := compute.BF16
				if fp32 {
					wantW = compute.F32
				}
				for i := range s.Model.Blocks {
					bl := &s.Model.Blocks[i]
					for _, l := range bl.Linears() {
						if l.W.DType() != wantW {
							t.Fatalf("%s: the decoder binds a %v weight, want %v", l.Name, l.W.DType(), wantW)
						}
					}
					if bl.InNorm.W.DType() != compute.F32 || bl.Router != nil && bl.Router.W.DType() != compute.F32 {
						t.Fatalf("block %d: a norm or router weight is not fp32", i)
					}
				}
				norms := zero3Steps(t, s, rows, &opt, total)
				// (The gathers of the steps only: Weights gathers fp32
				// blocks into the slots, BF16 gathers' masters through
				// broadcasts.)
				r := result{norms: norms, log: &gatherLog{Collective: g.Collective, calls: g.calls}, sper: s.sh.sper}
				r.w = s.Weights()
				for _, u := range s.sh.units {
					if u.block >= 0 {
						r.block = append(r.block, u.per)
					} else {
						r.out = append(r.out, u.per)
					}
				}
				return r
			}
			bf, f32 := run(false), run(true)
			// And the unsharded student (its GEMMs read its weights' BF16
			// shadows; a group of one's pieces are its tensors, in order).
			us, err := NewStudentOn(c.cfg, be)
			if err != nil {
				t.Fatal(err)
			}
			if err := us.Load(model.Init(c.cfg, model.InitOptions{Seed: 5})); err != nil {
				t.Fatal(err)
			}
			one := result{norms: zero3Steps(t, us, rows, &opt, total), w: us.Weights()}
			us.Free()
			for name, w := range f32.w {
				for j := range w {
					if math.Float32bits(bf.w[name][j]) != math.Float32bits(w[j]) {
						t.Fatalf("%s[%d] = %g with BF16 gathers, %g with fp32 gathers", name, j, bf.w[name][j], w[j])
					}
				}
			}
			for i := range f32.norms {
				if bf.norms[i] != f32.norms[i] {
					t.Fatalf("step %d: gradient norm %g with BF16 gathers, %g with fp32", i+1, bf.norms[i], f32.norms[i])
				}
			}
			// The unsharded student: within fp32 reordering, the GEMMs
			// reading the same BF16 weights (its shadows). A sharded step
			// sums a row's gradients from zero and adds the sum to the
			// rank's part, where the unsharded one accumulates each
			// contribution in place: a tensor with several contributions
			// a row differs in the last bits (the MoE's embedding, a
			// token seen twice; its router), the fp32 gathers' alike.
			worst, differ, in := 0.0, 0, map[string]bool{}
			for name, w := range one.w {
				for j := range w {
					if bf.w[name][j] != w[j] {
						differ, in[name] = differ+1, true
						worst = max(worst, math.Abs(float64(bf.w[name][j]-w[j])))
					}
				}
			}
			if worst > 1e-6 {
				t.Fatalf("the unsharded student's weights differ by up to %g (%d values, in %v)", worst, differ, slices.Sorted(maps.Keys(in)))
			}
			t.Logf("the unsharded student: %d weights differ, by up to %g, in %v", differ, worst, slices.Sorted(maps.Keys(in)))
			is := func(n int, ps []int) bool { return slices.Contains(ps, n) }
			var blockCalls, smallCalls int
			for _, cl := range bf.log.calls {
				switch {
				case cl.dt == compute.BF16 && is(cl.n, bf.block):
					blockCalls++
				case cl.dt == compute.F32 && is(cl.n, bf.out):
				case cl.dt == compute.F32 && cl.n == bf.sper:
					smallCalls++
				default:
					t.Fatalf("BF16 gathers: a gather of %d %v elements a rank, neither a block's (BF16, %v), an outside unit's (F32, %v) nor the small tensors' pack (F32, %d)", cl.n, cl.dt, bf.block, bf.out, bf.sper)
				}
			}
			var fpBlock int64
			for _, cl := range f32.log.calls {
				switch {
				case cl.dt == compute.F32 && is(cl.n, f32.block):
					fpBlock += int64(cl.n) * 4
				case cl.dt == compute.F32 && is(cl.n, f32.out):
				default:
					t.Fatalf("fp32 gathers: a gather of %d %v elements a rank", cl.n, cl.dt)
				}
			}
			if smallCalls != 3 || blockCalls == 0 {
				t.Fatalf("BF16 gathers: %d of the blocks, %d of the small tensors' pack over 3 steps (want > 0 and 3)", blockCalls, smallCalls)
			}
			if got := bf.log.bytes(compute.BF16); 2*got != fpBlock {
				t.Fatalf("the blocks' gathers moved %d bytes in BF16, %d in fp32: want half", got, fpBlock)
			}
			t.Logf("3 steps: the blocks' gathers moved %d bytes (BF16) instead of %d (fp32); the small tensors' pack %d bytes a step; weights and gradient norms bit for bit",
				bf.log.bytes(compute.BF16), fpBlock, 4*bf.sper)
		})
	}
}

// zero3Steps trains s three steps on every row of rows (one rank's, or an
// unsharded student), clipping at 0.5; it returns the gradient norms.
func zero3Steps(t *testing.T, s *Student, rows []*Batch, opt *loss.Options, total float64) []float64 {
	t.Helper()
	ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
	if err != nil {
		t.Fatal(err)
	}
	defer ad.Free()
	var norms []float64
	for step := 0; step < 3; step++ {
		s.ZeroGrad()
		for _, b := range rows {
			if _, err := s.ForwardBackward(b, opt, total); err != nil {
				t.Fatal(err)
			}
		}
		if s.ShardStage() > 0 {
			s.AllReduceGrads(nil)
		}
		norms = append(norms, optim.ClipGradNormSum(s.Groups(), 0.5, func(x float64) float64 { return x }))
		ad.Step(3e-3)
		s.AfterStep()
	}
	return norms
}

// TestCUDAShardedQADGathersFP32: NVFP4 QAD on a stage 2 or 3 student
// that gathers BF16 is refused, naming Sharding.FP32Gathers; made with it,
// a QAD student's gathers are all fp32 (its calibration and fake
// quantization read the fp32 weights) and it trains.
func TestCUDAShardedQADGathersFP32(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := tinyConfig(model.ArchQwen3, false)
	for _, stage := range []int{2, 3} {
		c := ncclOfOne(t, be)
		s, err := NewShardedStudentOn(cfg, be, Sharding{C: c, Stage: stage})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.EnableQAD(); err == nil || !strings.Contains(err.Error(), "FP32Gathers") {
			t.Fatalf("stage %d: EnableQAD on a student that gathers BF16: %v, want a refusal naming Sharding.FP32Gathers", stage, err)
		}
		if err := s.RestoreQAD(nil); err == nil || !strings.Contains(err.Error(), "FP32Gathers") {
			t.Fatalf("stage %d: RestoreQAD on a student that gathers BF16: %v, want a refusal naming Sharding.FP32Gathers", stage, err)
		}
		s.Free()
		c.Close()
		g := &gatherLog{Collective: ncclOfOne(t, be)}
		s, err = NewShardedStudentOn(cfg, be, Sharding{C: g, Stage: stage, Overlap: true, FP32Gathers: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 5})); err != nil {
			t.Fatal(err)
		}
		rows := []*Batch{testBatch(11, 97, 8), testBatch(12, 97, 8)}
		opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
		shardSteps(t, s, shardCase{cfg: cfg, qad: true}, rows, func(int) bool { return true }, &opt, 40, func(x float64) float64 { return x })
		if n := g.bytes(compute.BF16); n != 0 || len(g.calls) == 0 {
			t.Fatalf("stage %d, QAD: %d gathers, %d bytes of them BF16: want every gather fp32", stage, len(g.calls), n)
		}
		s.Free()
		g.Close()
	}
}
