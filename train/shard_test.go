package train

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"distill/compute"
	"distill/compute/computetest"
	"distill/compute/device"
	"distill/model"
	"distill/train/loss"
	"distill/train/optim"
)

// shardCase is one student trained by TestShardedStudent.
type shardCase struct {
	name string
	cfg  *model.Config
	qad  bool
}

// TestShardedStudent: ranks of ZeRO stages 2 and 3 (2 and 3 ranks of an
// in-process group; each rank its own CPU backend) train three steps of
// a dense Qwen3 (tied and untied embeddings), a Qwen2 (biases), a
// Qwen3-MoE and an NVFP4 QAD student, each rank the rows i mod N of a
// step of 4 rows (so one rank of 3 runs a Phantom pass), and end where
// one unsharded student trained on all 4 rows ends: every weight within
// 1e-5 of it (the rank order of the sums, fp32), the same gradient norms,
// and every rank's gathered Weights equal to rank 0's bit for bit. A
// rank's master pieces, gradients and moments hold 1/N of the parameters
// (plus padding). A checkpoint's Weights (a gather) after step 1 changes
// nothing. With Sharding.Overlap (its double gradient buffers, three
// weight slots and prefetches; on the CPU the work runs in order) every
// weight equals the run without it bit for bit.
func TestShardedStudent(t *testing.T) {
	qadCfg := tinyConfig(model.ArchQwen3, false)
	qadCfg.Hidden, qadCfg.Intermediate, qadCfg.HeadDim, qadCfg.Heads, qadCfg.KVHeads = 32, 48, 16, 2, 1
	cases := []shardCase{
		{"qwen3", tinyConfig(model.ArchQwen3, false), false},
		{"qwen3-tied", tinyConfig(model.ArchQwen3, true), false},
		{"qwen2", tinyConfig(model.ArchQwen2, false), false},
		{"moe", tinyMoEConfig(false, 1), false},
		{"qad", qadCfg, true},
		{"qwen3-4layers", deepConfig(4), false}, // (overlap: the gradient buffers and weight slots come round)
	}
	rows := []*Batch{testBatch(11, 97, 8), testBatch(12, 97, 8), testBatch(13, 97, 8), testBatch(14, 97, 8)}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	total := 0.0
	for _, b := range rows {
		for _, m := range b.Mask {
			total += float64(m)
		}
	}
	for _, c := range cases {
		want, wantNorms := trainUnsharded(t, c, rows, &opt, total)
		for _, stage := range []int{2, 3} {
			for _, n := range []int{2, 3} {
				t.Run(fmt.Sprintf("%s/zero%d/ranks%d", c.name, stage, n), func(t *testing.T) {
					got, norms := trainSharded(t, c, stage, n, false, rows, &opt, total)
					over, _ := trainSharded(t, c, stage, n, true, rows, &opt, total)
					for name, v := range got[0] {
						for j := range v {
							if v[j] != over[0][name][j] {
								t.Fatalf("%s[%d] = %g with overlap, %g without", name, j, over[0][name][j], v[j])
							}
						}
					}
					for i := range norms {
						if math.Abs(norms[i]-wantNorms[i]) > 1e-5*wantNorms[i] {
							t.Errorf("step %d: gradient norm %g, unsharded %g", i+1, norms[i], wantNorms[i])
						}
					}
					for r := 1; r < n; r++ {
						for name, v := range got[r] {
							for j := range v {
								if v[j] != got[0][name][j] {
									t.Fatalf("rank %d's %s[%d] = %g, rank 0's %g", r, name, j, v[j], got[0][name][j])
								}
							}
						}
					}
					worst, at := 0.0, ""
					for name, w := range want {
						v := got[0][name]
						if len(v) != len(w) {
							t.Fatalf("%s: %d values, want %d", name, len(v), len(w))
						}
						for j := range w {
							if d := math.Abs(float64(v[j] - w[j])); d > worst {
								worst, at = d, fmt.Sprintf("%s[%d]", name, j)
							}
						}
					}
					if worst > 1e-5 {
						t.Errorf("weights after 3 steps: worst |sharded - unsharded| %g at %s", worst, at)
					}
				})
			}
		}
	}
}

// shardSteps trains s three steps on rows (those of mine), all-reducing
// the gradients' squares through sum, stepping AdamW over s's groups; it
// returns the gradient norms.
func shardSteps(t *testing.T, s *Student, c shardCase, rows []*Batch, mine func(int) bool, opt *loss.Options, total float64, sum func(float64) float64) []float64 {
	t.Helper()
	if c.qad {
		if err := s.EnableQAD(); err != nil {
			t.Fatal(err)
		}
		for _, b := range rows { // every rank calibrates on every row
			if _, err := s.Forward(b, opt); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.FinishCalibration(); err != nil {
			t.Fatal(err)
		}
	}
	ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
	if err != nil {
		t.Fatal(err)
	}
	defer ad.Free()
	var norms []float64
	for step := 0; step < 3; step++ {
		s.ZeroGrad()
		ran := 0
		for i, b := range rows {
			if !mine(i) {
				continue
			}
			if _, err := s.ForwardBackward(b, opt, total); err != nil {
				t.Fatal(err)
			}
			ran++
		}
		if sum != nil {
			for ; ran < 2; ran++ { // 4 rows: 2 a rank at most
				s.Phantom(true)
			}
			s.AllReduceGrads(nil)
		}
		norms = append(norms, optim.ClipGradNormSum(s.Groups(), 0.5, sum))
		ad.Step(3e-3)
		s.AfterStep()
		if step == 0 {
			s.Weights() // as a checkpoint does: it fills the slots between fetches
		}
	}
	return norms
}

func trainUnsharded(t *testing.T, c shardCase, rows []*Batch, opt *loss.Options, total float64) (map[string][]float32, []float64) {
	s, err := NewStudentOn(c.cfg, device.CPU(1))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Load(model.Init(c.cfg, model.InitOptions{Seed: 5})); err != nil {
		t.Fatal(err)
	}
	norms := shardSteps(t, s, c, rows, func(int) bool { return true }, opt, total, nil)
	return s.Weights(), norms
}

func trainSharded(t *testing.T, c shardCase, stage, n int, overlap bool, rows []*Batch, opt *loss.Options, total float64) ([]map[string][]float32, []float64) {
	g := computetest.NewHostGroup(n)
	out, norms := make([]map[string][]float32, n), make([][]float64, n)
	var wg sync.WaitGroup
	errs := make([]any, n)
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			defer func() { errs[r] = recover() }()
			be := device.CPU(1)
			col := g.Rank(r, be)
			s, err := NewShardedStudentOn(c.cfg, be, Sharding{C: col, Stage: stage, Overlap: overlap})
			if err != nil {
				panic(err)
			}
			if err := s.Load(model.Init(c.cfg, model.InitOptions{Seed: 5})); err != nil {
				panic(err)
			}
			checkShardSizes(t, s, n)
			buf := be.New(compute.F32, 1)
			sum := func(x float64) float64 {
				be.WriteF32(buf, []float32{float32(x)})
				col.AllReduceSum(buf, 1)
				v := make([]float32, 1)
				be.ReadF32(buf, v)
				return float64(v[0])
			}
			norms[r] = shardSteps(t, s, c, rows, func(i int) bool { return i%n == r }, opt, total, sum)
			out[r] = s.Weights()
		}(r)
	}
	wg.Wait()
	for r, e := range errs {
		if e != nil {
			t.Fatalf("rank %d: %v", r, e)
		}
	}
	return out, norms[0]
}

// checkShardSizes: a rank's groups hold its 1/n of the parameters, and
// the pieces of the ranks cover every tensor exactly once.
func checkShardSizes(t *testing.T, s *Student, n int) {
	P := 0
	for _, ts := range s.Tensors {
		P += ts.N
	}
	mine := 0
	for _, g := range s.Groups() {
		mine += g.P.Len()
	}
	units := len(s.sh.units)
	if mine > P/n+units {
		t.Errorf("a rank's groups hold %d of %d parameters, want <= %d/%d + %d units' padding", mine, P, P, n, units)
	}
	seen := make([][]int, len(s.Tensors))
	for i, ts := range s.Tensors {
		seen[i] = make([]int, ts.N)
	}
	for r := 0; r < n; r++ {
		for _, p := range s.ShardPieces(r) {
			for j := p.Off; j < p.Off+p.N; j++ {
				seen[p.Tensor][j]++
			}
		}
	}
	for i, c := range seen {
		for j, k := range c {
			if k != 1 {
				t.Errorf("%s[%d] is in %d ranks' pieces, want 1", s.Tensors[i].Name, j, k)
				return
			}
		}
	}
}

// TestShardingErrors: a stage other than 2 or 3 is refused, naming it.
func TestShardingErrors(t *testing.T) {
	g := computetest.NewHostGroup(1)
	be := device.CPU(1)
	_, err := NewShardedStudentOn(tinyConfig(model.ArchQwen3, false), be, Sharding{C: g.Rank(0, be), Stage: 1})
	if err == nil || !strings.Contains(err.Error(), "ZeRO stage 1") {
		t.Fatalf("stage 1: %v", err)
	}
}

// deepConfig is tinyConfig's untied Qwen3 with n layers.
func deepConfig(n int) *model.Config {
	c := tinyConfig(model.ArchQwen3, false)
	c.Layers = n
	return c
}

// TestShardedCPUGathersFP32: the CPU backend's GEMMs read fp32, so its
// stage 3 student gathers fp32 (no BF16 rounding, slots or gathers) and
// binds fp32 weights, whatever Sharding.FP32Gathers says.
func TestShardedCPUGathersFP32(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	rows := []*Batch{testBatch(11, 97, 8)}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	be := device.CPU(1)
	g := &gatherLog{Collective: computetest.NewHostGroup(1).Rank(0, be)}
	s, err := NewShardedStudentOn(cfg, be, Sharding{C: g, Stage: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 5})); err != nil {
		t.Fatal(err)
	}
	shardSteps(t, s, shardCase{cfg: cfg}, rows, func(int) bool { return true }, &opt, 20, func(x float64) float64 { return x })
	if s.sh.bf16 || s.sh.slots[0].DType() != compute.F32 {
		t.Fatalf("the CPU's stage 3 student gathers BF16 (%v) or has %v slots", s.sh.bf16, s.sh.slots[0].DType())
	}
	for _, l := range s.Model.Blocks[0].Linears() {
		if l.W.DType() != compute.F32 {
			t.Fatalf("%s: %v weights on the CPU", l.Name, l.W.DType())
		}
	}
	if n := g.bytes(compute.BF16); n != 0 || len(g.calls) == 0 {
		t.Fatalf("%d gathers, %d bytes of them BF16: want every gather fp32 on the CPU", len(g.calls), n)
	}
}

// TestGEMMWeightsAreLinears: the blocks' tensors that BF16 gathers move
// in BF16 (gemmWeight) are exactly the weights of the decoder's Linears
// (Block.Linears: q/k/v/o, the MLP's or every expert's gate/up/down; not
// the router, the norms or the biases), for every architecture.
func TestGEMMWeightsAreLinears(t *testing.T) {
	for _, cfg := range []*model.Config{tinyConfig(model.ArchLlama, false), tinyConfig(model.ArchQwen2, false), tinyConfig(model.ArchQwen3, true), tinyMoEConfig(false, 2)} {
		s, err := NewStudentOn(cfg, device.CPU(1))
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]bool{}
		for i := range s.Model.Blocks {
			for _, l := range s.Model.Blocks[i].Linears() {
				want[l.Name+".weight"] = true
			}
		}
		n := 0
		for _, ts := range s.Tensors {
			if blockOf(ts.Name) < 0 {
				continue
			}
			if gemmWeight(ts.Name) != want[ts.Name] {
				t.Errorf("%s %s: gemmWeight %v, a Linear's weight %v", cfg.Arch, ts.Name, gemmWeight(ts.Name), want[ts.Name])
			}
			if want[ts.Name] {
				n++
			}
		}
		if n != len(want) || n == 0 {
			t.Errorf("%s: %d of the %d Linears' weights found", cfg.Arch, n, len(want))
		}
	}
}
