package trainer

import (
	"fmt"
	"io"
	"math"

	"distill/cache"
	"distill/compute"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
)

// stepper is one optimizer step over a step's packed rows: the forward,
// loss and backward of each row, gradients accumulated over the step and
// normalized by its count of loss positions (so the gradient is that of
// the mean over the whole global batch, whatever the packing), then the
// global gradient-norm clip and the AdamW update, which a non-finite
// norm skips.
type stepper struct {
	s        *train.Student
	ad       *optim.AdamW
	clip     []optim.Group // every parameter's gradient: the clip's (ad's groups are a rank's pieces under ZeRO-1)
	lopt     *loss.Options
	sched    optim.Schedule
	maxNorm  float64
	teachers []TeacherState // multi-teacher KD: their names and weights
	stop     stopSignal
	log      io.Writer
	g        *ranks // data parallel: this rank runs its rows, then the sums are reduced
	z1       *zero1 // ZeRO-1: after AdamW, the ranks share their slices of the parameters
	overlap  bool   // train.overlap_comm: ZeRO 0 and 1 all-reduce the blocks' gradients during the last row's backward
	// open are the step's rows whose loss values (and MoE routing
	// statistics) forwardBackward left on the device (train.PendingStats),
	// read by readStats once update has read the gradient norm; total is
	// the step's loss positions.
	open  []*train.PendingStats
	total int
}

// forwardBackward accumulates the gradients of rows into the zeroed
// gradients, and their losses into sm. Options.Stop abandons the step
// between rows with errStopped, having changed neither weights nor
// moments.
func (sp *stepper) forwardBackward(step int, rows []*train.Batch, sm *StepMetrics) error {
	total, tokens := 0, 0
	for _, b := range rows {
		total += counted(b)
		tokens += len(b.Tokens)
	}
	sm.Tokens, sm.LossTokens, sm.Rows = tokens, total, len(rows)
	sp.open = nil // (an abandoned step's rows)
	sp.s.ZeroGrad()
	last := -1 // this rank's last row of the step
	for i := range rows {
		if sp.g.mine(i) {
			last = i
		}
	}
	for i, b := range rows {
		if !sp.g.mine(i) {
			continue // another rank's row
		}
		if i == last && sp.g.size > 1 && sp.overlap {
			sp.s.ReduceInBackward(sp.g.c) // (ZeRO 0 and 1: the blocks' all-reduces beside its backward)
		}
		if testHookRow != nil {
			testHookRow(step, i)
		}
		if sp.stop.requested() {
			fmt.Fprintf(sp.log, "step %d abandoned (row %d of %d)\n", step, i, len(rows))
			return errStopped
		}
		sp.s.SetStepRow(step, i) // keys a LoRA student's dropout masks
		p, err := sp.s.ForwardBackwardPending(b, sp.lopt, float64(total))
		if err != nil {
			return err
		}
		sp.open = append(sp.open, p)
	}
	// Sharded, every rank runs as many backwards as rank 0 (which has
	// the most rows): their collectives pair up.
	for k := sp.g.rowsOf(len(rows), sp.g.rank); k < sp.g.rowsOf(len(rows), 0); k++ {
		sp.s.Phantom(true)
	}
	sp.total = total
	if sp.g.size > 1 { // the ranks' loss sums are reduced with the gradients
		routed := sp.reduce(sm, sp.readStats(sm))
		sp.normalize(sm, total)
		sm.ExpertShare, sm.ExpertShareByLayer = expertShares(routed)
	}
	return nil
}

// readStats reads the losses of the step's rows that forwardBackward
// left on the device into sm, as token-weighted sums, and (on one rank)
// turns them into the step's means and expert shares; it returns the
// rows' MoE routing counts (per layer and expert, the step's choices).
// On a GPU, one rank reads them after the gradient norm, whose read
// already waited for the whole step: the host then waits once a step,
// not once a row in the middle of the loss head or after each MoE
// layer's routing (the values are the same bits either way).
func (sp *stepper) readStats(sm *StepMetrics) [][]int {
	if sp.open == nil {
		return nil
	}
	var routed [][]int
	for _, p := range sp.open {
		sp.accumulate(sm, p.Stats())
		routed = addRouting(routed, p.Routing().Counts)
	}
	sp.open = nil
	if sp.g.size <= 1 {
		sp.normalize(sm, sp.total)
		sm.ExpertShare, sm.ExpertShareByLayer = expertShares(routed)
	}
	return routed
}

// reduce sums the ranks' gradients and their shares of the step's loss
// sums and MoE routing counts (in fp32: metrics only), and returns the
// step's routing counts.
func (sp *stepper) reduce(sm *StepMetrics, routed [][]int) [][]int {
	sp.g.reduceGrads(sp.s)
	if sp.teachers != nil && sm.Teachers == nil {
		sm.Teachers = make([]TeacherMetrics, len(sp.teachers))
	}
	cfg := sp.s.Cfg
	if routed == nil { // no row of this step was this rank's
		for l := 0; l < cfg.Layers; l++ {
			if cfg.IsMoE(l) {
				routed = append(routed, make([]int, cfg.NumExperts))
			}
		}
	}
	v := []float64{sm.Loss, sm.KD, sm.CE, sm.AuxLoss}
	for _, t := range sm.Teachers {
		v = append(v, t.KD, t.Top1)
	}
	for _, c := range routed {
		for _, n := range c {
			v = append(v, float64(n))
		}
	}
	sp.g.reduceSums(v)
	sm.Loss, sm.KD, sm.CE, sm.AuxLoss = v[0], v[1], v[2], v[3]
	v = v[4:]
	for i := range sm.Teachers {
		sm.Teachers[i].KD, sm.Teachers[i].Top1 = v[0], v[1]
		v = v[2:]
	}
	for _, c := range routed {
		for e := range c {
			c[e] = int(v[0] + 0.5)
			v = v[1:]
		}
	}
	return routed
}

// accumulate adds a row's losses to sm, weighted by its loss positions.
func (sp *stepper) accumulate(sm *StepMetrics, bs loss.Stats) {
	w := float64(bs.Tokens)
	sm.Loss += bs.Loss * w
	sm.KD += bs.KD * w
	sm.CE += bs.CE * w
	if sp.teachers != nil && sm.Teachers == nil {
		sm.Teachers = make([]TeacherMetrics, len(sp.teachers))
	}
	for i, t := range bs.Teachers {
		sm.Teachers[i].KD += t.KD * w
		sm.Teachers[i].Top1 += t.Top1 * w
	}
	sm.AuxLoss += bs.Aux * w
}

// addRouting adds a row's MoE routing counts (per layer, per expert) to
// the step's.
func addRouting(routed, counts [][]int) [][]int {
	for l, c := range counts {
		if l == len(routed) {
			routed = append(routed, make([]int, len(c)))
		}
		for e, v := range c {
			routed[l][e] += v
		}
	}
	return routed
}

// normalize turns the step's weighted sums into means over its total
// loss positions, and names the teachers.
func (sp *stepper) normalize(sm *StepMetrics, total int) {
	if total > 0 {
		sm.Loss, sm.KD, sm.CE = sm.Loss/float64(total), sm.KD/float64(total), sm.CE/float64(total)
		sm.AuxLoss /= float64(total)
		for i := range sm.Teachers {
			sm.Teachers[i].KD /= float64(total)
			sm.Teachers[i].Top1 /= float64(total)
		}
	}
	nameTeachers(sm.Teachers, sp.teachers)
}

// update clips the gradients to optim.max_grad_norm and steps AdamW at
// the schedule's learning rate, unless the norm is not finite: one bad
// batch must not poison the weights, so the update is skipped (sm says
// so) and the moments stay untouched. It reports whether it stepped.
func (sp *stepper) update(step int, sm *StepMetrics) bool {
	var sum func(float64) float64
	if sp.s.ShardStage() > 0 { // each rank holds its pieces' gradients
		sum = func(x float64) float64 {
			v := []float64{x}
			sp.g.reduceSums(v)
			return v[0]
		}
	}
	sm.GradNorm = optim.ClipGradNormSum(sp.clip, sp.maxNorm, sum)
	sp.readStats(sm) // (after the norm's wait: readStats)
	sm.LR = sp.sched.LR(step)
	if math.IsNaN(sm.GradNorm) || math.IsInf(sm.GradNorm, 0) {
		sm.Skipped = true
		return false
	}
	sp.ad.Step(sm.LR)
	if sp.z1 != nil {
		sp.z1.share()
	}
	sp.s.AfterStep()
	return true
}

// calibrate switches NVFP4 QAD on and calibrates the amax on the first n
// packed rows of the training order (a separate pass over the order, so
// training then sees the same data with or without QAD).
func calibrate(s *train.Student, n int, src Source, held cache.Range, seqLen int, lopt *loss.Options, log io.Writer) error {
	if err := s.EnableQAD(); err != nil {
		return err
	}
	done, err := calibrationPass(s, n, src, held, seqLen, lopt)
	if err != nil {
		return err
	}
	if err := s.FinishCalibration(); err != nil {
		return err
	}
	fmt.Fprintf(log, "NVFP4: calibrated amax on %d rows, frozen\n", done)
	return nil
}

// calibrateInputs calibrates a LoRA student's Linears' input amax (for
// its merged model's NVFP4 export) on the first n packed rows of the
// training order, as calibrate does QAD's; the forward is an
// evaluation's (no dropout), so training is the same with or without it.
func calibrateInputs(s *train.Student, n int, src Source, held cache.Range, seqLen int, lopt *loss.Options, log io.Writer) error {
	if err := s.StartInputCalibration(); err != nil {
		return err
	}
	done, err := calibrationPass(s, n, src, held, seqLen, lopt)
	if err != nil {
		return err
	}
	if err := s.FinishInputCalibration(); err != nil {
		return err
	}
	fmt.Fprintf(log, "LoRA: calibrated the Linears' input amax on %d rows, for the merged model's NVFP4 export\n", done)
	return nil
}

// calibrationPass runs Forward over the first n packed rows of the
// training order (a separate pass over the order, so training then sees
// the same data with or without it) and returns how many it ran.
func calibrationPass(s *train.Student, n int, src Source, held cache.Range, seqLen int, lopt *loss.Options) (int, error) {
	cs, err := src.Batches(held, 0, 0)
	if err != nil {
		return 0, err
	}
	defer cs.Close()
	done := 0
	for done < n {
		rows, err := cs.Next(seqLen)
		if err != nil {
			return done, fmt.Errorf("NVFP4 calibration: %w", err)
		}
		for _, b := range rows {
			if done == n {
				break
			}
			if _, err := s.Forward(b, lopt); err != nil {
				return done, fmt.Errorf("NVFP4 calibration: %w", err)
			}
			done++
		}
	}
	return done, nil
}

// testHookRow, when set (tests), runs before each row of a step.
var testHookRow func(step, row int)

// testHookBackend, when set (tests), receives the run's backend when it
// opens.
var testHookBackend func(compute.Backend)
