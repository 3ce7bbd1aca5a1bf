package cuda

import (
	"testing"

	"distill/compute/cuda/cudaemu"
)

// useEmu points the library variables at the CPU emulator (package
// cudaemu) for the test.
func useEmu(t testing.TB) { cudaemu.Use(t) }

// TestEmuReverseOrder reruns the kernels that use shared memory and warp
// collectives with the emulator's threads scheduled in reverse order
// (DISTILL_EMU_REVERSE=1), so that a barrier missing in either direction
// fails one of the two runs.
func TestEmuReverseOrder(t *testing.T) {
	if onGPU() {
		t.Skip("an emulator test")
	}
	t.Setenv("DISTILL_EMU_REVERSE", "1")
	t.Run("attention", TestAttentionConformance)
	t.Run("lmhead", TestLMHeadTopKConformance)
	t.Run("lmhead_ties", TestLMHeadTopKTies)
	t.Run("rmsnorm", TestRMSNormConformance)
	t.Run("rope", TestRoPEConformance)
	t.Run("moe", TestMoEConformance)
	t.Run("moe_grouped", TestMoEGroupedGEMM)
	t.Run("moe_grouped_backward", TestMoEGroupedBackward)
	t.Run("moe_fp8_grouped", TestMoEFP8Grouped)
	t.Run("attn_plan", TestAttnPlanKernel)
	t.Run("reductions", TestReductionsConformance)
	t.Run("layer_backward", TestLayerBackwardConformance)
	t.Run("rmsnorm_dw", TestRMSNormDWFused)
	t.Run("attention_backward", TestAttentionBackwardConformance)
	t.Run("loss_head", TestLossHeadConformance)
}
