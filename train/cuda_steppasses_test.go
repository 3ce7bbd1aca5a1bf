package train

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
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
