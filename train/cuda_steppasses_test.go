package train

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
	"distill/train/optim"
)

// TestCUDAStepConversions pins the pure conversion and copy passes of a
// CUDA training step (issue 23: producers write BF16 themselves): in the
// third step of a dense Qwen3, Qwen2 and Llama student (every weight
// shadow made by then, as in any step of a run), forward, backward, the
// gradient norm and AdamW, the emulator's profile counts each launch of a
// kernel that only converts or moves (k_f32_to_bf16, k_bf16_to_f32,
// k_add_bf16, k_add_bf16_act, k_add_to_act, device-to-device copies) by
// name. What remains is cuDNN's attention backward widening its BF16 dq
// and dk into the F32 gradients RoPE's backward rotates (and Qwen2's dv,
// which its bias's column sums read in F32): widened, not added, as the
// gradients were zeroed for the call (compute/cuda zeros.go); a BF16 dv
// cuDNN writes in place. No rounding pass, and no copy (the attention
// statistics are 16-byte aligned views, which cuDNN reads in place). A
// new stray conversion or copy, or one more a call, fails the test.
func TestCUDAStepConversions(t *testing.T) {
	cudaemu.Use(t)
	llamaBias := tinyConfig(model.ArchLlama, false)
	llamaBias.AttentionBias = true
	for _, c := range []struct {
		name string
		stepCase
		// the passes a cuDNN attention backward call makes (dq and dk
		// widened; an F32 dv widened, a BF16 one written by cuDNN)
		perCall map[string]int
	}{
		{"qwen3", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeNone, false, -1}, map[string]int{"k_bf16_to_f32": 2}},
		{"qwen3 full", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeFull, false, -1}, map[string]int{"k_bf16_to_f32": 2}},
		{"qwen3 qad", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeNone, true, -1}, map[string]int{"k_bf16_to_f32": 2}},
		{"qwen2", stepCase{tinyConfig(model.ArchQwen2, true), decoder.RecomputeNone, false, -1}, map[string]int{"k_bf16_to_f32": 3}},
		{"llama", stepCase{tinyConfig(model.ArchLlama, false), decoder.RecomputeSelective, false, -1}, map[string]int{"k_bf16_to_f32": 2}},
		{"llama attention bias", stepCase{llamaBias, decoder.RecomputeNone, false, -1}, map[string]int{"k_bf16_to_f32": 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			be, err := cuda.Open(cuda.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer be.Close()
			rg := c.rig(t, be)
			defer rg.s.Free()
			got := map[string]int{}
			calls := 0
			for step := 0; step < 3; step++ {
				be.SetProfile(step == 2)
				rg.forwardBackward(t, step)
				rg.update()
				if step != 2 {
					continue
				}
				for _, e := range be.Profile() {
					switch name := strings.TrimSuffix(e.Name, "_x4"); {
					case e.Name == "cudnn attention backward":
						calls = e.Calls
					case conversionPass(name):
						got[name] += e.Calls
					}
				}
			}
			if want := 2 * c.cfg.Layers; calls != want {
				// testBatch's samples run in two groups (attnGroups)
				t.Fatalf("%d cuDNN attention backward calls, want %d", calls, want)
			}
			want := map[string]int{}
			for k, v := range c.perCall {
				want[k] = v * calls
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("conversion and copy passes of a step: %v, want %v", sorted(got), sorted(want))
			}
			t.Logf("%d attention backward calls; conversion and copy passes %v", calls, sorted(got))
		})
	}
}

// conversionPass reports whether a profile entry (its _x4 suffix
// trimmed) is a pass that only converts or moves data.
func conversionPass(name string) bool {
	switch name {
	case "k_f32_to_bf16", "k_bf16_to_f32", "k_add_bf16", "k_add_bf16_act", "k_add_to_act", "memcpy DtoD":
		return true
	}
	return false
}

func sorted(m map[string]int) string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	var b strings.Builder
	for _, k := range ks {
		fmt.Fprintf(&b, "%s:%d ", k, m[k])
	}
	return strings.TrimSpace(b.String())
}

// TestCUDAShardedStepPasses pins what a sharded step (ZeRO stages 2 and
// 3, with and without Sharding.Overlap, over an NCCL group of one: the
// emulator's stand-in) does beyond the unsharded step of the same tied
// 4-layer Qwen3 (the benchmark's tied shape, BenchmarkCUDATrainStepZeRO),
// one row, in the third step, from the emulator's profile
// (cuda.ProfileEntry's calls and bytes) and host waits:
//
//   - the memsets write the unsharded step's bytes (the whole gradients
//     zeroed once: each unit's after its reduction, not again by
//     ZeroGrad), in a launch a unit instead of one;
//   - no device-to-device copy; the BF16 gathers' pack of the small
//     tensors is two k_copy_multi;
//   - the rounding passes (k_f32_to_bf16): the LM head's once a row (its
//     gathered weights have no shadow; pass 1 and pass 2 share it), and
//     no other: AdamW writes the blocks' BF16 whole weights at stage 2
//     and the rank's BF16 parts at stage 3 (with
//     $DISTILL_ZERO3_ROUND_PER_GATHER=1, each stage-3 block gather rounds:
//     2L - slots a row);
//   - NCCL: every unit reduce-scattered once (4 bytes a parameter
//     written), and the all-gathers of the layout: at stage 2 every unit
//     once after the step (blocks in BF16), at stage 3 each block gather
//     (BF16), the embedding once a row and the final norm after the
//     step; and the small tensors' pack;
//   - with overlap, the second stream's event waits: at stage 2 two a
//     block's reduction, two for the reductions after the backward and
//     two for the gathers after the step; at stage 3 also the gathers'
//     and prefetches' (26 for these 4 layers, counted in the comment
//     below);
//   - every other kernel, GEMM and cuDNN call as many times as unsharded,
//     and the same host waits.
//
// A new pass over the weights or gradients, a copy, a zeroing, or a wait
// fails it.
func TestCUDAShardedStepPasses(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := deepConfig(4)
	cfg.TieEmbeddings = true
	L := cfg.Layers
	row := testBatch(11, cfg.VocabSize, 8)
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	type stepRun struct {
		prof  map[string]cuda.ProfileEntry
		waits map[string]int
		sh    *shards // the sharded student's layout (freed: its sizes only)
	}
	run := func(stage int, overlap bool) stepRun {
		var s *Student
		var c compute.Collective
		if stage == 0 {
			s, err = NewStudentOn(cfg, be)
		} else {
			c = ncclOfOne(t, be)
			defer c.Close()
			s, err = NewShardedStudentOn(cfg, be, Sharding{C: c, Stage: stage, Overlap: overlap})
		}
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
		r := stepRun{prof: map[string]cuda.ProfileEntry{}, waits: map[string]int{}, sh: s.sh}
		for step := 0; step < 3; step++ {
			be.SetProfile(step == 2)
			be.CountHostWaits(step == 2)
			s.ZeroGrad()
			if _, err := s.ForwardBackward(row, &opt, 0); err != nil {
				t.Fatal(err)
			}
			if stage > 0 {
				s.AllReduceGrads(c)
			}
			optim.ClipGradNorm(ad.Groups, 1)
			ad.Step(1e-3)
			s.AfterStep()
		}
		for _, w := range be.HostWaits() {
			r.waits[w.Kind+" "+w.Site] += w.Count
		}
		be.CountHostWaits(false)
		for _, e := range be.Profile() {
			name := strings.TrimSuffix(e.Name, "_x4")
			x := r.prof[name]
			x.Name, x.Calls, x.Bytes = name, x.Calls+e.Calls, x.Bytes+e.Bytes
			r.prof[name] = x
		}
		be.SetProfile(false)
		return r
	}
	base := run(0, false)
	P := cfg.Params()
	for _, c := range []struct {
		stage     int
		overlap   bool
		waits     int  // the second stream's event waits
		perGather bool // $DISTILL_ZERO3_ROUND_PER_GATHER=1
	}{
		// Stage 3 with overlap, 4 layers: the forward's gathers of the
		// embedding, blocks 0 and 1 (each beside, then waited for) and
		// the prefetches of blocks 2 and 3 (beside; waited for by their
		// Fetch), 10; the backward's reductions of the final norm and the
		// embedding (2 each), the four blocks' (1 each beside, and the
		// waits of blocks 1 and 0's Fetch for the reductions of 3 and 2,
		// and the drain's for 1 and 0's), block 0's prefetch and its
		// wait (2), the final norm's gather after the step (2), 16.
		{2, false, 0, false}, {2, true, 2*L + 4, false}, {3, false, 0, false}, {3, true, 26, false}, {3, false, 0, true},
	} {
		t.Run(fmt.Sprintf("zero%d/overlap=%v/round_per_gather=%v", c.stage, c.overlap, c.perGather), func(t *testing.T) {
			if c.perGather {
				t.Setenv("DISTILL_ZERO3_ROUND_PER_GATHER", "1")
			}
			got := run(c.stage, c.overlap)
			if (got.sh.bfPart == nil) != (c.stage == 2 || c.perGather) {
				t.Fatalf("stage %d, round per gather %v: bfPart %v", c.stage, c.perGather, got.sh.bfPart)
			}
			h := got.sh
			var rs, ag, blockPer, outSlot, whole int64
			for _, u := range h.units {
				rs += 4 * int64(u.per)
				switch {
				case u.block >= 0:
					blockPer = int64(u.per) // (the layers are alike)
				case u.outSlot:
					outSlot += int64(u.per)
				default:
					whole += int64(u.per)
				}
			}
			slots := int64(h.nslot)
			gathers := int64(L) // stage 2: each block once, after the step
			rounds := 1         // the LM head's, once a row
			if c.stage == 3 {
				gathers = 2*int64(L) - slots // forward, and backward past the slots
				if c.perGather {
					rounds += int(gathers)
				}
			}
			ag = 2*gathers*blockPer + 4*(outSlot+whole) + 4*int64(h.sper)
			want := map[string][2]int64{ // calls, bytes
				"ncclReduceScatter": {int64(len(h.units)), rs},
				"ncclAllGather":     {gathers + int64(len(h.units)-L) + 1, ag},
				"k_copy_multi":      {2, 0},
				"k_f32_to_bf16":     {int64(rounds), 0},
				"memset":            {int64(base.prof["memset"].Calls - 1 + len(h.units)), base.prof["memset"].Bytes},
			}
			if c.waits > 0 {
				want["stream wait (event)"] = [2]int64{int64(c.waits), 0}
			}
			names := map[string]bool{}
			for n := range got.prof {
				names[n] = true
			}
			for n := range base.prof {
				names[n] = true
			}
			for n := range want {
				names[n] = true
			}
			for n := range names {
				g, b := got.prof[n], base.prof[n]
				w, pinned := want[n]
				if !pinned {
					w = [2]int64{int64(b.Calls), b.Bytes}
				}
				if int64(g.Calls) != w[0] || g.Bytes != w[1] {
					t.Errorf("%s: %d calls writing %d bytes, want %d and %d (unsharded: %d and %d)", n, g.Calls, g.Bytes, w[0], w[1], b.Calls, b.Bytes)
				}
			}
			if fmt.Sprint(got.waits) != fmt.Sprint(base.waits) {
				t.Errorf("host waits %v, unsharded %v", got.waits, base.waits)
			}
			t.Logf("%d parameters: the reduce-scatters wrote %.2f bytes a parameter, the all-gathers %.2f; %d rounding passes; %d memsets (unsharded %d); %d event waits",
				P, float64(rs)/float64(P), float64(ag)/float64(P), rounds, got.prof["memset"].Calls, base.prof["memset"].Calls, c.waits)
		})
	}
}
