package trainer

import (
	"fmt"
	"io"
	"strings"

	"distill/cache"
	"distill/compute"
	"distill/internal/errkind"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
)

// planK is the width of the teachers' top-k the loss head uploads per
// position: the cache's k, or for several teachers at most the sum of
// theirs (the union of their ids).
func planK(m *cache.Manifest, ts *teacherSet) int {
	if ts == nil {
		return m.DenseK()
	}
	k := 0
	for _, tm := range ts.ms {
		k += tm.DenseK()
	}
	return k
}

// planShape is the memory plan's shape of a run of cfg for a student of
// mc, under recompute mode r, on backend be: its activation dtype, and
// the attention workspace it reports for a row of one sample of
// data.seq_len tokens (cuDNN's: the decoder cuts a packed row's attention
// backward into runs of samples that ask for no more, decoder.attnGroups).
func planShape(cfg *Config, mc *model.Config, k int, r decoder.Recompute, be compute.Backend, ranks int) train.PlanShape {
	sh := train.PlanShape{Model: mc, RowTokens: cfg.Data.SeqLen, K: k, QAD: cfg.Quant == "nvfp4", Recompute: r, Activations: be.ActDType(), LoRA: cfg.TrainLoRA()}
	if wr, ok := be.(compute.AttentionWorkspaceReporter); ok && cfg.Data.SeqLen > 0 {
		sh.AttnWorkspace = wr.AttentionWorkspaceBytes(1, cfg.Data.SeqLen, mc.Heads, mc.KVHeads, mc.HeadDim)
	}
	if ranks > 1 { // one process ignores train.zero
		sh.Ranks, sh.ZeRO, sh.Overlap = ranks, cfg.Train.ZeRO, cfg.Train.Overlap()
	}
	return sh
}

// planRecompute picks train.recompute's mode and checks it against the
// device before step 1 (on a backend with device memory; the CPU trains
// in host memory: auto is none there). The device's free memory is
// measured now, with the parameters, gradients and AdamW moments (and a
// resumed QAD run's quantized weights) allocated, so the plan's budget is
// that free memory less the reserve, plus those terms. auto takes the
// least recomputation that fits (prev, the checkpoint's mode, first when
// it fits: the resumed steps then run on the same buffers). A mode that
// does not fit is an ErrDeviceMemory naming the modes that fit, and the
// longest data.seq_len that fits under each mode. Where the chosen mode
// leaves room, the loss head keeps its logits (train.KeepLogitsFit).
func planRecompute(cfg *Config, s *train.Student, k int, prev decoder.Recompute, ranks int, log io.Writer) (decoder.Recompute, error) {
	want := cfg.Train.Recompute
	dm, ok := s.Backend().(compute.DeviceMemory)
	if !ok {
		if want == "auto" || want == "" {
			if prev != "" {
				return prev, nil
			}
			return decoder.RecomputeNone, nil
		}
		return decoder.ParseRecompute(want)
	}
	free, total := dm.MemInfo()
	reserve := train.DeviceReserve(total)
	p0 := train.PlanMemory(planShape(cfg, s.Cfg, k, decoder.RecomputeNone, s.Backend(), ranks))
	resident := p0.Term(train.TermParams) + p0.Term(train.TermGrads) + p0.Term(train.TermMoments) + p0.Term(train.TermLoRABase)
	if s.Model.QAD() && !s.Model.Calibrating() {
		resident += p0.Term(train.TermQAD)
	}
	if s.ShardStage() > 0 {
		// A sharded student's BF16 weight copies are its layers' BF16
		// whole weights (stage 3's slots, stage 2's own), allocated with
		// it (an unsharded one's are made at the first GEMM after a
		// step).
		resident += p0.Term(train.TermShadows)
	}
	budget := free - reserve + resident
	need := func(r decoder.Recompute) int64 {
		p := train.PlanMemory(planShape(cfg, s.Cfg, k, r, s.Backend(), ranks))
		return p.Total()
	}
	fits := func(r decoder.Recompute) bool { return need(r) <= budget }
	var pick decoder.Recompute
	if want == "auto" || want == "" {
		if prev != "" && fits(prev) {
			pick = prev
		} else {
			for _, r := range decoder.RecomputeModes {
				if fits(r) {
					pick = r
					break
				}
			}
		}
	} else {
		r, err := decoder.ParseRecompute(want)
		if err != nil {
			return "", errkind.Errorf(ErrConfig, "train.recompute: %w", err)
		}
		if fits(r) {
			pick = r
		}
	}
	if pick != "" {
		how := "train.recompute " + want
		if want == "auto" || want == "" {
			how = "chosen by train.recompute auto"
			if pick == prev {
				how = "the checkpoint's, kept by train.recompute auto"
			}
		}
		// The loss head keeps a row's logits between its passes where the
		// plan has room for them beside the mode's: the same results, one
		// GEMM of three a vocabulary tile fewer.
		withKeep, keep := train.KeepLogitsFit(planShape(cfg, s.Cfg, k, pick, s.Backend(), ranks), budget)
		planned, logits := need(pick), "the loss head recomputes its logits in its second pass (keeping them needs "+train.HumanBytes(withKeep)+")"
		if keep {
			planned, logits = withKeep, "the loss head keeps its logits between its passes"
		}
		s.SetKeepLogits(keep)
		fmt.Fprintf(log, "memory plan: recompute %s (%s): %s of the %s the device has for the run (%s, %s kept in reserve); %s; `student plan` prints the plan\n",
			pick, how, train.HumanBytes(planned), train.HumanBytes(budget), train.HumanBytes(total), train.HumanBytes(reserve), logits)
		return pick, nil
	}
	var largest []string
	for _, r := range decoder.RecomputeModes {
		sh := planShape(cfg, s.Cfg, k, r, s.Backend(), ranks)
		n := train.LargestRow(sh, budget, max(s.Cfg.MaxPositions, cfg.Data.SeqLen))
		largest = append(largest, fmt.Sprintf("%d with %s", n, r))
	}
	var ok2 []string
	for _, r := range decoder.RecomputeModes {
		if fits(r) {
			ok2 = append(ok2, fmt.Sprintf("%s (%s)", r, train.HumanBytes(need(r))))
		}
	}
	mode := want
	if want == "auto" || want == "" {
		mode = string(decoder.RecomputeFull)
	}
	fix := "lower data.seq_len"
	if len(ok2) > 0 {
		fix = "set train.recompute: " + strings.Join(ok2, " or ") + ", or lower data.seq_len"
	}
	if ranks > 1 && cfg.Train.Overlap() {
		// The overlap's buffers (a layer's gradients, at stage 3 a layer's
		// weights) may be what does not fit.
		off := *cfg
		f := false
		off.Train.OverlapComm = &f
		if n := train.PlanMemory(planShape(&off, s.Cfg, k, decoder.Recompute(mode), s.Backend(), ranks)).Total(); n <= budget {
			fix += fmt.Sprintf(", or set train.overlap_comm: false (%s with recompute %s: the collectives then run in order with the compute)", train.HumanBytes(n), mode)
		}
	}
	return "", fmt.Errorf("%w: rows of data.seq_len %d tokens with train.recompute %s need %s of device memory (parameters, gradients and AdamW moments %s, activations %s), but the device has %s for the run (%s, %s kept in reserve): %s (the longest row that fits: %s), or train on a device with more memory; `student plan --config FILE` prints the plan",
		ErrDeviceMemory, cfg.Data.SeqLen, want, train.HumanBytes(need(decoder.Recompute(mode))), train.HumanBytes(resident),
		train.HumanBytes(train.PlanMemory(planShape(cfg, s.Cfg, k, decoder.Recompute(mode), s.Backend(), ranks)).Term(train.TermActivations)),
		train.HumanBytes(max(0, budget)), train.HumanBytes(total), train.HumanBytes(reserve), fix, strings.Join(largest, ", "))
}
