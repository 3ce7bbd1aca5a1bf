package cuda

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"distill/compute"
	"distill/infer"
)

// TestForwardDeviceBytes: the device memory the whole teacher's forward
// takes beside the weights, measured by the pool's high-water mark
// (PeakMemory), is within infer's bound (Model.DeviceBytes: the decoder's
// activations plus ForwardScratchBytes), and the bound is not loose (at
// most twice the measurement), on every golden checkpoint (dense, biases,
// tied, MoE) and batch shapes of one long sample, ragged samples and a
// large k.
func TestForwardDeviceBytes(t *testing.T) {
	be := testBackend(t)
	for _, dir := range goldenDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			m, err := infer.Load(dir, be)
			if err != nil {
				t.Fatal(err)
			}
			m.Forward([][]int32{{0}}, 1, 1) // the copies of weights the backend keeps from their first use
			r := rand.New(rand.NewPCG(1, 2))
			for _, c := range []struct {
				lens []int
				k    int
			}{{[]int{150}, 8}, {[]int{61, 3, 17, 1, 40}, 16}, {[]int{90, 33}, 500}} {
				samples, tokens, maxLen := make([][]int32, len(c.lens)), 0, 0
				for i, n := range c.lens {
					samples[i] = make([]int32, n)
					for j := range samples[i] {
						samples[i][j] = int32(r.IntN(m.Cfg.VocabSize))
					}
					tokens, maxLen = tokens+n, max(maxLen, n)
				}
				be.ResetPeakMemory()
				base := be.PeakMemory()
				m.Forward(samples, c.k, 1)
				got := be.PeakMemory() - base
				bound := m.DeviceBytes(tokens, maxLen, c.k, 0)
				t.Logf("lengths %v, k %d: peak %d bytes beside the weights, bound %d (%.2fx)", c.lens, c.k, got, bound, float64(bound)/float64(got))
				if got > bound || bound > 2*got {
					t.Errorf("lengths %v, k %d: the forward took %d bytes beside the weights; DeviceBytes says %d: want peak <= bound <= 2·peak", c.lens, c.k, got, bound)
				}
			}
		})
	}
}

// TestForwardDrawsDeviceBytes: a forward that also draws (a fill of
// sampled or head+sampled targets) stays within infer's bound for its
// draws (Model.DeviceBytes with draws: the uniforms, the drawn ids and
// the LM head's per-row draw scratch), which is not loose either.
func TestForwardDrawsDeviceBytes(t *testing.T) {
	be := testBackend(t)
	m, err := infer.Load(filepath.Join("..", "..", "infer", "testdata", "golden", "qwen3"), be)
	if err != nil {
		t.Fatal(err)
	}
	m.Forward([][]int32{{0}}, 1, 1)
	r := rand.New(rand.NewPCG(3, 4))
	samples, tokens := [][]int32{make([]int32, 70), make([]int32, 23)}, 93
	for _, smp := range samples {
		for j := range smp {
			smp[j] = int32(r.IntN(m.Cfg.VocabSize))
		}
	}
	for _, c := range []struct {
		k, n int
		head bool
	}{{0, 300, false}, {8, 300, true}, {8, 24, true}} {
		d := infer.Draws{N: c.n, Head: c.head, U: func(s, t, dd int) float64 { return float64(dd) / 512 }} // ascending, multiples of 2^-53
		be.ResetPeakMemory()
		base := be.PeakMemory()
		m.ForwardDraws(samples, c.k, 1, d)
		got := be.PeakMemory() - base
		bound := m.DeviceBytes(tokens, 70, c.k, c.n)
		t.Logf("k %d, %d draws (head %v): peak %d bytes beside the weights, bound %d (%.2fx)", c.k, c.n, c.head, got, bound, float64(bound)/float64(got))
		if got > bound || bound > 2*got {
			t.Errorf("k %d, %d draws: the forward took %d bytes beside the weights; DeviceBytes says %d: want peak <= bound <= 2·peak", c.k, c.n, got, bound)
		}
	}
}

// TestCheckDeviceFit: on a device that the weights leave little room in
// (the emulator's device shrunk by DISTILL_EMU_DEVICE_MEM after loading),
// a token budget that does not fit is refused with an error naming a
// budget that does; that budget passes the check, one more token does
// not, and a forward of that many tokens runs on a device holding exactly
// what the bound asks for (no reserve), so the suggestion is safe.
func TestCheckDeviceFit(t *testing.T) {
	if onGPU() {
		t.Skip("shrinks the emulator's device; on a GPU the memory is what it is")
	}
	be := testBackend(t)
	m, err := infer.Load("../../infer/testdata/golden/qwen3", be)
	if err != nil {
		t.Fatal(err)
	}
	const k = 8
	if err := m.CheckDeviceFit(1000, 1000, k, 0); err != nil {
		t.Fatalf("16 GiB emulated device: %v", err)
	}
	free, total := be.MemInfo()
	used := total - free
	room := m.DeviceBytes(300, 300, k, 0)
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(used+256<<20+room))
	err = m.CheckDeviceFit(1000, 1000, k, 0)
	if !errors.Is(err, infer.ErrDeviceMemory) {
		t.Fatalf("budget 1000 with room for about 300 tokens: %v, want ErrDeviceMemory", err)
	}
	sub := regexp.MustCompile(`lower --token-budget to (\d+) or less`).FindStringSubmatch(err.Error())
	if sub == nil {
		t.Fatalf("the error names no budget that fits: %v", err)
	}
	t.Logf("%v", err)
	fits, _ := strconv.Atoi(sub[1])
	if fits < 300 || fits >= 1000 {
		t.Fatalf("suggested budget %d; the device has room for at least 300 and not 1000", fits)
	}
	if err := m.CheckDeviceFit(fits, fits, k, 0); err != nil {
		t.Fatalf("the suggested budget %d: %v", fits, err)
	}
	if err := m.CheckDeviceFit(fits+1, fits+1, k, 0); err == nil {
		t.Fatalf("budget %d passes, but %d was said to be the largest that fits", fits+1, fits)
	}
	// The bound alone, without the reserve, is enough for the forward.
	free, total = be.MemInfo()
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(total-free+m.DeviceBytes(fits, fits, k, 0)))
	sample := make([]int32, fits)
	for i := range sample {
		sample[i] = int32(i % m.Cfg.VocabSize)
	}
	m.Forward([][]int32{sample}, k, 1) // panics with CUDA_ERROR_OUT_OF_MEMORY if the bound is short

	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(used+1<<20))
	err = m.CheckDeviceFit(1000, 1000, k, 0)
	if !errors.Is(err, infer.ErrDeviceMemory) || !regexp.MustCompile(`not even one token fits`).MatchString(err.Error()) {
		t.Fatalf("a device the weights fill: %v", err)
	}
}

// TestForwardScratchBytes: each kernel call's own scratch, measured by the
// pool's high-water mark around the call (inputs and outputs allocated
// before), is within forwardScratchBytes of a shape with those dimensions,
// for shapes where that call's term is the largest: a MatMul with a wide
// input (BF16 rounding of x), a MoE layer with many experts per token
// (the grouping and the experts' activations), and the LM head (its logit
// tile). TestForwardDeviceBytes checks the whole forward, where the LM
// head dominates on the tiny golden checkpoints; at real sizes the MatMul
// and MoE terms do, and this is their check.
func TestForwardScratchBytes(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(21, 22))
	weight := func(n int) compute.Tensor {
		w, err := be.Weight(randBF16(r, n, 0.05))
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	scratch := func(call func()) int64 {
		be.ResetPeakMemory()
		base := be.PeakMemory()
		call()
		return be.PeakMemory() - base
	}
	check := func(name string, got int64, s compute.ForwardShape) {
		t.Helper()
		bound := forwardScratchBytes(s)
		t.Logf("%s: scratch %d bytes, bound %d", name, got, bound)
		if got > bound || 2*got < bound {
			t.Errorf("%s: the call took %d bytes of scratch; forwardScratchBytes says %d: want scratch <= bound <= 2·scratch", name, got, bound)
		}
	}

	// MatMul: x (m, 12000) F32 rounded to BF16; the LM head of this shape
	// (one tile of 4096 columns) and the attention tile list are smaller.
	m, n, k := 200, 16, 12000
	x, out, w := be.FromF32(randF32(r, m*k)), be.New(compute.F32, m*n), weight(n*k)
	check("MatMul", scratch(func() { be.MatMul(out, x, w, nil, m, n, k) }),
		compute.ForwardShape{Tokens: m, MaxLen: m, K: 8, Hidden: 16, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: k, Vocab: 64})

	// MoE: 160 tokens, top-8 of 16 experts of width 1024 (the experts'
	// activations, 2.6 MB, outgrow the LM head's tile of this shape).
	T, H, I, E, K := 160, 64, 1024, 16, 8
	mw := &compute.MoEWeights{Router: weight(E * H), NumExperts: E, TopK: K, Hidden: H, Inter: I}
	for e := 0; e < E; e++ {
		mw.Gate, mw.Up, mw.Down = append(mw.Gate, weight(I*H)), append(mw.Up, weight(I*H)), append(mw.Down, weight(H*I))
	}
	be.MoE(be.New(compute.F32, T*H), be.FromF32(randF32(r, T*H)), mw, T) // the router's F32 copy, kept from the first call
	mx, mout := be.FromF32(randF32(r, T*H)), be.New(compute.F32, T*H)
	check("MoE", scratch(func() { be.MoE(mout, mx, mw, T) }),
		compute.ForwardShape{Tokens: T, MaxLen: T, K: 8, Hidden: H, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: 16, Vocab: 64,
			Experts: E, TopK: K, MoEIntermediate: I})

	// The LM head: 100 tokens over a vocabulary of 9000 (three tiles).
	tokens, hidden, vocab, topk := 100, 32, 9000, 16
	lx, lw := be.FromF32(randF32(r, tokens*hidden)), weight(vocab*hidden)
	ids, lp := be.New(compute.I32, tokens*topk), be.New(compute.F32, tokens*topk)
	check("LMHeadTopK", scratch(func() { be.LMHeadTopK(ids, lp, lx, lw, tokens, hidden, vocab, topk) }),
		compute.ForwardShape{Tokens: tokens, MaxLen: tokens, K: topk, Hidden: hidden, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: 16, Vocab: vocab})

	// The same LM head drawing 40 ids a token beside its top-k (a
	// head+sampled fill), slabs forced small: the draws' per-row scratch.
	const draws = 40
	uf := make([]float64, tokens*draws)
	for i := range uf {
		uf[i] = float64(i%draws) / 64 // ascending a token, multiples of 2^-53
	}
	pu := make([]int32, 2*len(uf))
	compute.PackUniforms(pu, uf)
	u, drawn, tail := be.FromI32(pu), be.New(compute.I32, tokens*draws), be.New(compute.F32, tokens)
	saveR := lmMaxRows
	lmMaxRows = 32
	check("LMHeadSample", scratch(func() { be.LMHeadSample(ids, lp, drawn, tail, lx, lw, u, tokens, hidden, vocab, topk, draws, true) }),
		compute.ForwardShape{Tokens: tokens, MaxLen: tokens, K: topk, Hidden: hidden, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: 16, Vocab: vocab, Draws: draws})
	lmMaxRows = saveR
}
