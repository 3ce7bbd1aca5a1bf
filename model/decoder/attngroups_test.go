package decoder

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/compute/device"
	"distill/model"
)

// TestAttnGroups: the runs cover the samples in order, each within the
// bucket bound (pow2(count)·pow2(longest)² <= pow2(tokens)·pow2(the
// batch's longest)); a batch of one sample, or of equal short samples that
// fit, stays whole (nil); one long sample among many short ones is cut.
func TestAttnGroups(t *testing.T) {
	long := []int32{0, 2, 4, 44, 46, 48, 50, 52}
	for _, c := range []struct {
		starts []int32
		want   [][2]int
	}{
		{[]int32{0, 8192}, nil},
		{[]int32{0, 64, 128, 192, 256}, nil},
		{long, [][2]int{{0, 2}, {2, 3}, {3, 7}}},
	} {
		if got := attnGroups(c.starts); !slices.Equal(got, c.want) {
			t.Errorf("attnGroups(%v) = %v, want %v", c.starts, got, c.want)
		}
	}
	// Random packings: runs in order, covering, within the bound.
	r := rand.New(rand.NewPCG(1, 2))
	for it := 0; it < 200; it++ {
		starts := []int32{0}
		for n := 1 + r.IntN(40); n > 0; n-- {
			l := 1 + r.IntN(8)
			if r.IntN(10) == 0 {
				l = 1 + r.IntN(3000)
			}
			starts = append(starts, starts[len(starts)-1]+int32(l))
		}
		runs := attnGroups(starts)
		if runs == nil {
			runs = [][2]int{{0, len(starts) - 1}}
		}
		longest := 0
		for s := 0; s+1 < len(starts); s++ {
			longest = max(longest, int(starts[s+1]-starts[s]))
		}
		limit := int64(pow2(int(starts[len(starts)-1]))) * int64(pow2(longest))
		next := 0
		for _, run := range runs {
			if run[0] != next || run[1] <= run[0] {
				t.Fatalf("starts %v: runs %v do not cover the samples in order", starts, runs)
			}
			next = run[1]
			m := 0
			for s := run[0]; s < run[1]; s++ {
				m = max(m, int(starts[s+1]-starts[s]))
			}
			if c := int64(pow2(run[1]-run[0])) * int64(pow2(m)) * int64(pow2(m)); c > limit && run[1]-run[0] > 1 {
				t.Fatalf("starts %v: run %v costs %d > %d", starts, run, c, limit)
			}
		}
		if next != len(starts)-1 {
			t.Fatalf("starts %v: runs %v stop at sample %d", starts, runs, next)
		}
	}
}

// TestAttentionGroupsSameGradients: a batch of one long sample among short
// ones, whose attention backward runs as three calls on views, trains the
// same bits as one call (attnGroupsOff), on the CUDA backend (the
// emulator, or a GPU; the decoder cuts its batches) and on the CPU (made
// to), with and without Qwen3's q/k norms; the CPU's batches stay whole
// unless told.
func TestAttentionGroupsSameGradients(t *testing.T) {
	tokens := make([]int32, 52)
	for i := range tokens {
		tokens[i] = int32((7*i + 3) % 97)
	}
	starts := []int32{0, 2, 4, 44, 46, 48, 50, 52}
	if attnGroups(starts) == nil {
		t.Fatal("test setup: the batch is not cut")
	}
	backends := map[string]func(t *testing.T) compute.Backend{
		"cpu": func(t *testing.T) compute.Backend {
			// The CPU's attention sizes no workspace: the decoder cuts its
			// batches only when told to.
			attnGroupsAlways = true
			t.Cleanup(func() { attnGroupsAlways = false })
			return device.CPU(3)
		},
		"cuda": func(t *testing.T) compute.Backend {
			cudaemu.Use(t)
			be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { be.Close() })
			return be
		},
	}
	// Untold, the CPU keeps the batch whole.
	cfg0 := tinyConfig(model.ArchLlama)
	cpu := device.CPU(1)
	w0 := model.Init(cfg0, model.InitOptions{Seed: 5})
	m0, err := New(cfg0, cpu, func(name string) (compute.Tensor, compute.Tensor, error) {
		return cpu.FromF32(w0[name]), cpu.New(compute.F32, len(w0[name])), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m0.TrainForward(tokens, starts); err != nil {
		t.Fatal(err)
	}
	if m0.train.b.groups != nil {
		t.Fatalf("the CPU's batch was cut into %d runs", len(m0.train.b.groups))
	}
	m0.Free()
	for _, name := range []string{"cpu", "cuda"} {
		for _, arch := range []model.Arch{model.ArchLlama, model.ArchQwen3} {
			t.Run(fmt.Sprintf("%s/%s", name, arch), func(t *testing.T) {
				be := backends[name](t)
				cfg := tinyConfig(arch)
				run := func() [][]float32 {
					w := model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.2, Perturb: true})
					var grads []compute.Tensor
					m, err := New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
						g := be.New(compute.F32, len(w[name]))
						grads = append(grads, g)
						return be.FromF32(w[name]), g, nil
					})
					if err != nil {
						t.Fatal(err)
					}
					defer m.Free()
					if _, err := m.TrainForward(tokens, starts); err != nil {
						t.Fatal(err)
					}
					if cut := m.train.b.groups != nil; cut == attnGroupsOff {
						t.Fatalf("the batch cut into runs: %v (attnGroupsOff %v)", cut, attnGroupsOff)
					}
					r := rand.New(rand.NewPCG(7, 8))
					dl := make([]float32, len(tokens)*cfg.Hidden)
					for i := range dl {
						dl[i] = float32(r.NormFloat64())
					}
					be.WriteF32(be.View(m.HiddenGrad(), 0, len(dl)), dl)
					m.Backward()
					var out [][]float32
					for _, g := range grads {
						v := make([]float32, g.Len())
						be.ReadF32(g, v)
						out = append(out, v)
					}
					return out
				}
				got := run()
				attnGroupsOff = true
				want := run()
				attnGroupsOff = false
				for i := range want {
					for j := range want[i] {
						if math.Float32bits(got[i][j]) != math.Float32bits(want[i][j]) {
							t.Fatalf("gradient %d[%d]: %v in runs, %v in one call", i, j, got[i][j], want[i][j])
						}
					}
				}
			})
		}
	}
}

// TestAttnGroupsFreed: on the CUDA backend (the emulator, or a GPU), a
// forward of a batch the training path would cut (the teacher's TopK)
// leaves the device's free memory as it found it, and so does a training
// step once the model is freed: no run's starts outlive their batch.
func TestAttnGroupsFreed(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := tinyConfig(model.ArchQwen3)
	w := model.Init(cfg, model.InitOptions{Seed: 5})
	m, err := New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		return be.FromF32(w[name]), be.New(compute.F32, len(w[name])), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var samples [][]int32
	for _, n := range []int{2, 2, 40, 2, 2, 2, 2} {
		samples = append(samples, make([]int32, n))
	}
	m.TopK(samples, 4, 1) // the backend's first-use copies
	free0, _ := be.MemInfo()
	for i := 0; i < 3; i++ {
		m.TopK(samples, 4, 1)
	}
	if free, _ := be.MemInfo(); free != free0 {
		t.Errorf("three forwards changed the free device memory by %d bytes", free0-free)
	}
	tokens, starts := make([]int32, 52), []int32{0, 2, 4, 44, 46, 48, 50, 52}
	for i := 0; i < 2; i++ {
		if _, err := m.TrainForward(tokens, starts); err != nil {
			t.Fatal(err)
		}
		if m.train.b.groups == nil {
			t.Fatal("the training batch was not cut into runs")
		}
	}
	m.Free()
	m.TopK(samples, 4, 1) // Free released the forward's RoPE table too; a forward makes it again
	if free, _ := be.MemInfo(); free != free0 {
		t.Errorf("two training forwards, then Free and a forward, changed the free device memory by %d bytes", free0-free)
	}
}
