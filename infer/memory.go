package infer

import (
	"errors"
	"fmt"
	"strings"

	"distill/compute"
)

// ActivationBytes bounds what one Forward over tokens tokens (longest
// sample maxLen, top-k) allocates beside the weights: the decoder's
// activations (decoder.Model.ActivationBytes), the host copies of the
// result and of the batch, and the backend's kernel scratch when it
// reports it (compute.ScratchReporter; the CPU backend does). TopK never
// forwards more than Options.TokenBudget tokens at once, so with n =
// TokenBudget and maxLen = min(TokenBudget, MaxPositions), peak RSS <=
// weights + ActivationBytes. The kernel scratch terms are per worker: a
// backend allocates them in its first forward and reuses them after, so
// only that first forward reaches the bound's scratch share.
//
// On one backend only: a pipeline's stages hold their own (DeviceBytes).
func (m *Model) ActivationBytes(tokens, maxLen, k int) int64 {
	c := m.Cfg
	n := int64(tokens)
	b := m.last().d.ActivationBytes(tokens, k)
	b += 4 * 2 * n * int64(k)     // host copies of the top-k (the result)
	b += 4 * (2*n + 1)            // host tokens and starts
	b += 4 * n * int64(c.HeadDim) // host RoPE table before its upload
	if sr, ok := m.Backend().(compute.ScratchReporter); ok {
		b += sr.AttentionScratchBytes(maxLen) + sr.LMHeadScratchBytes(k)
	}
	if c.NumExperts > 0 {
		// MoE: router logits and choices, plus the routed rows of the
		// busiest expert (at most all n tokens): x, gate, up, y.
		E, K, H, Im := int64(c.NumExperts), int64(c.ExpertsPerTok), int64(c.Hidden), int64(c.MoEIntermediate)
		b += 4 * (n*E + 2*n*K + 2*n*K + n*(2*H+2*Im))
		b += 24 * n * K // per-expert row lists (grown by append: up to 2x)
	}
	return b + 64<<10 // slice headers, goroutines, work items
}

// DeviceBytes bounds the device memory one Forward over tokens tokens
// (top-k; with draws > 0, ForwardDraws drawing that many a position)
// allocates beside the weights on a backend with device memory
// (compute.DeviceMemory): the decoder's activations, which stay on the
// device for the whole forward, the draws' uniforms and results, and the
// kernels' peak scratch. 0 on a backend without device memory. In a
// pipeline: the largest of its stages' (StageDeviceBytes).
func (m *Model) DeviceBytes(tokens, maxLen, k, draws int) int64 {
	var b int64
	for i := range m.stages {
		b = max(b, m.StageDeviceBytes(i, tokens, maxLen, k, draws))
	}
	return b
}

// StageDeviceBytes is DeviceBytes of stage i of a pipeline: what it
// allocates beside its weights for a forward of tokens tokens (a
// micro-batch is never larger), by the plan's terms (StageBytes) with its
// device's own kernel scratch: the activations, the hand-off of every
// stage but the last, the draws and the LM head on the last.
func (m *Model) StageDeviceBytes(i, tokens, maxLen, k, draws int) int64 {
	st := m.stages[i]
	dm, ok := st.be.(compute.DeviceMemory)
	if !ok {
		return 0
	}
	scratch := func(s compute.ForwardShape) (int64, int64) { return dm.ForwardScratchBytes(s), 0 }
	return stageBytes(m.Cfg, st.be.ActDType(), tokens, maxLen, k, draws, i == len(m.stages)-1, m.weights == WeightsFP8, scratch).Total()
}

// deviceReserve is the device memory CheckDeviceFit leaves unplanned: the
// pool's rounding and fragmentation, NVRTC's and cuBLASLt's own
// allocations after start-up: 256 MiB or 2% of the device, the larger.
func deviceReserve(total int64) int64 { return max(256<<20, total/50) }

// CheckDeviceFit checks, on a backend with device memory, that a forward
// of budget tokens (samples of at most maxLen, top-k up to kMax) fits in
// what the device has free once the weights are loaded, so that a budget
// too large for the device is refused at start-up, naming one that fits,
// instead of failing every batch with an out-of-memory error. It runs one
// forward of a single token first: the backend keeps copies of some
// weights from their first use, and MemInfo then counts them. maxDraws >
// 0 plans for fills of sampled targets drawing up to that many a
// position too. A pipeline is checked device by device (stages sharing a
// device add up), and the error names the device that is short and the
// largest budget every device holds. nil on backends without device
// memory.
func (m *Model) CheckDeviceFit(budget, maxLen, kMax, maxDraws int) error {
	groups := m.deviceGroups()
	if len(groups) == 0 {
		return nil
	}
	if err := m.firstForward(); err != nil {
		return err
	}
	var (
		short             *deviceGroup // the first device that is
		need, free, total int64        // its need at budget, its memory
		fits              = budget     // the largest budget every device holds
	)
	for _, g := range groups {
		f, t := g.dm.MemInfo()
		avail := f - deviceReserve(t)
		needs := func(n int) int64 {
			var b int64
			for _, i := range g.stages {
				s := m.StageDeviceBytes(i, n, min(maxLen, n), kMax, 0)
				if maxDraws > 0 {
					s = max(s, m.StageDeviceBytes(i, n, min(maxLen, n), kMax, maxDraws))
				}
				b += s
			}
			return b
		}
		if needs(budget) <= avail {
			continue
		}
		fits = min(fits, largestFitting(needs, avail)) // below budget: need grows with it
		if short == nil {
			short, need, free, total = g, needs(budget), f, t
		}
	}
	if short == nil {
		return nil
	}
	gib := func(b int64) string { return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30)) }
	draws := ""
	if maxDraws > 0 {
		draws = fmt.Sprintf(" and up to %d draws a position", maxDraws)
	}
	who := short.name
	if len(m.stages) > 1 {
		var parts []string
		for _, i := range short.stages {
			parts = append(parts, m.stages[i].plan.What())
		}
		who = fmt.Sprintf("%s (pipeline stage of %s)", who, strings.Join(parts, "; "))
	}
	what := fmt.Sprintf("a forward of %d tokens with k up to %d%s needs %s of device memory beyond the weights (activations and kernel scratch), but %s of the device's %s is free after loading them (%s kept in reserve)",
		budget, kMax, draws, gib(need), gib(max(0, free)), gib(total), gib(deviceReserve(total)))
	if fits == 0 {
		what += ": not even one token fits"
	}
	return &FitError{Device: who, Piped: len(m.stages) > 1, Budget: fits, Weights: fits == 0, What: what}
}

// FitError is the error of a teacher that does not fit a GPU's memory
// (errors.Is: ErrDeviceMemory): its weights, which ran out of memory as
// they loaded (Load, LoadStages) or leave no room for a forward of one
// token beside them, or a forward of the token budget (CheckDeviceFit).
// Its message says what does not fit and what to change in general terms;
// a caller that knows its own flags (serve: teacherd's, cachectl fill's)
// words the fix from the fields.
type FitError struct {
	// Device names the GPU, and the stage's layers when the teacher is
	// pipelined: "GPU 1 (NVIDIA H100 80GB HBM3) (pipeline stage of
	// layers 40-79, norm, LM head)".
	Device string
	// What says what does not fit, in bytes.
	What string
	// Weights: the weights themselves do not fit (not even a forward of
	// one token fits beside them). Otherwise Budget is the largest token
	// budget that fits.
	Weights bool
	Budget  int
	// Piped: the teacher's layers are split over several stages.
	Piped bool
	// Err is the backend's error (the allocation that failed in a load),
	// or nil.
	Err error
}

func (e *FitError) Error() string {
	if !e.Weights {
		return fmt.Sprintf("%s: %s: lower --token-budget to %d or less (or lower the largest k, --k-max, or the draws, --max-draws)", e.Device, e.What, e.Budget)
	}
	fix := "spread the layers over more GPUs (--devices), or use GPUs with more memory"
	if !e.Piped && e.Err == nil {
		fix = "use a GPU with more memory, or --device cpu"
	}
	return fmt.Sprintf("%s: %s; %s", e.Device, e.What, fix)
}

func (e *FitError) Is(target error) bool { return target == ErrDeviceMemory }
func (e *FitError) Unwrap() error        { return e.Err }

// deviceGroup is the stages one device holds (several when stages share
// a GPU: their needs add up).
type deviceGroup struct {
	name   string
	dm     compute.DeviceMemory
	stages []int
}

// deviceGroups groups the stages on backends with device memory by
// device, in the order of their first stage.
func (m *Model) deviceGroups() []*deviceGroup {
	var groups []*deviceGroup
	byName := map[string]*deviceGroup{}
	for i, st := range m.stages {
		dm, ok := st.be.(compute.DeviceMemory)
		if !ok {
			continue
		}
		name := compute.DeviceName(st.be)
		g := byName[name]
		if g == nil {
			g = &deviceGroup{name: name, dm: dm}
			byName[name] = g
			groups = append(groups, g)
		}
		g.stages = append(g.stages, i)
	}
	return groups
}

// ErrDeviceMemory marks a forward size that does not fit the device's
// memory (CheckDeviceFit).
var ErrDeviceMemory = errors.New("infer: does not fit the device memory")

// firstForward runs a forward of one token, the backend's panic (an
// out-of-memory error from a device the weights leave no room on) turned
// into an error.
func (m *Model) firstForward() (err error) {
	defer func() {
		if r := recover(); r != nil {
			e, ok := r.(error)
			if !ok {
				e = fmt.Errorf("%v", r)
			}
			if !errors.Is(e, compute.ErrOutOfMemory) {
				err = fmt.Errorf("the first forward, of one token, failed: %w", e)
				return
			}
			var names []string
			for _, g := range m.deviceGroups() {
				names = append(names, g.name)
			}
			err = &FitError{Device: strings.Join(names, ", "), Weights: true, Piped: len(m.stages) > 1, Err: e,
				What: fmt.Sprintf("the first forward, of one token, ran out of memory after the weights loaded (%s)", strings.TrimPrefix(e.Error(), "cuda: "))}
		}
	}()
	m.Forward([][]int32{{0}}, 1, 1)
	return nil
}
