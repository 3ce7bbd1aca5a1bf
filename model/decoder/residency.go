package decoder

// Residency lets a student hold only some of its blocks' weights at a
// time (ZeRO stage 3: each rank keeps a shard of every parameter, and a
// block's whole weights are gathered when it runs) and hand each block's
// gradients on as soon as its backward has made them (stages 2 and 3:
// reduce-scattered to the rank that owns them, so no rank holds a whole
// model's gradients).
//
// The decoder calls Fetch(i) before it reads block i's weights (in the
// forward, also before block i-1's forward, whose fused residual add
// reads block i's input norm), and GradsDone(i) when block i's backward
// has accumulated every gradient of the block. Every rank of a sharded
// group runs the same sequence of calls (they are collectives).
type Residency interface {
	// Fetch makes block i's weights current and reports whether it
	// (re)loaded them, which makes their fake-quantized copies stale.
	Fetch(i int) bool
	// GradsDone takes block i's gradients of this backward.
	GradsDone(i int)
	// Slots is the number of block weight buffers the blocks share, in
	// turn (block i's is slot i mod Slots): 0 when every block has its
	// own.
	Slots() int
	// FetchOutside makes the weights of the tensors outside the blocks
	// that role (OutsideEmbed, OutsideHead) reads current: the
	// embedding table before the forward's lookup; the final norm and
	// the LM head before the last block's forward (which ends with the
	// final norm), current until Backward (the loss head reads the LM
	// head between TrainForward and Backward).
	FetchOutside(role int)
	// OutsideGradsDone takes role's gradients of this backward: the LM
	// head's (accumulated by the loss head before Backward) and the
	// final norm's after the final norm's backward; the embedding's
	// after its backward, the last.
	OutsideGradsDone(role int)
}

// Prefetcher is a Residency that can start fetching a block's weights
// before the Fetch that needs them (ZeRO 3 with overlap: the all-gather
// runs beside the compute). The decoder calls Prefetch(i+2) in the
// forward once blocks i and i+1 are fetched (block i's forward reads
// both: block i-1's weights are no longer read), and Prefetch(i-1) in
// the backward once block i is (block i+1's are no longer read); never
// for a block out of range. A Fetch of the block still follows.
type Prefetcher interface {
	Prefetch(i int)
}

// The roles of the tensors outside the blocks (Residency.FetchOutside).
const (
	OutsideEmbed = iota // the embedding table
	OutsideHead         // the final norm and the LM head (tied: the embedding table)
)

// SetResidency makes the model ask r for its blocks' weights and hand it
// their gradients (nil: every block's weights are always current and its
// gradients accumulate in place). Set it before EnableQAD or RestoreQAD.
func (m *Model) SetResidency(r Residency) {
	m.res = r
	m.qslot = nil
}

// fetch makes block i's weights current and, under QAD with shared
// slots, its fake-quantized weights too (the whole model's are refreshed
// at once otherwise, by TrainForward).
func (m *Model) fetch(i int) {
	if m.res == nil {
		return
	}
	loaded := m.res.Fetch(i)
	if !m.qad || m.calibrating || m.res.Slots() == 0 {
		return
	}
	s := i % len(m.qslot)
	if loaded || m.qslot[s] != i {
		for _, l := range m.Blocks[i].Linears() {
			m.be.FakeQuantNVFP4(l.Wfq, l.W, l.Out, l.In, l.WQ.Amax)
		}
		m.qslot[s] = i
	}
}

// prefetch starts fetching block i's weights (Prefetcher), if the
// residency can and i is a block.
func (m *Model) prefetch(i int) {
	if p, ok := m.res.(Prefetcher); ok && i >= 0 && i < len(m.Blocks) {
		p.Prefetch(i)
	}
}

// fetchOutside makes role's weights current (Residency.FetchOutside).
func (m *Model) fetchOutside(role int) {
	if m.res != nil {
		m.res.FetchOutside(role)
	}
}

// outsideGradsDone hands role's gradients to the residency.
func (m *Model) outsideGradsDone(role int) {
	if m.res != nil {
		m.res.OutsideGradsDone(role)
	}
}

// gradsDone hands block i's gradients to the residency.
func (m *Model) gradsDone(i int) {
	if m.res != nil {
		m.res.GradsDone(i)
	}
}

// sharedSlots reports whether the blocks share weight slots (and so
// their fake-quantized copies: one per slot).
func (m *Model) sharedSlots() bool { return m.res != nil && m.res.Slots() > 0 }

// Phantom runs the Residency calls of one TrainForward (and, with
// backward, one Backward) without computing anything: a sharded rank
// with no batch of its own keeps in step with ranks that have one.
func (m *Model) Phantom(backward bool) {
	if m.res == nil {
		return
	}
	m.fetchOutside(OutsideEmbed)
	for i := range m.Blocks {
		m.fetch(i)
		if i+1 < len(m.Blocks) {
			m.fetch(i + 1)
		} else {
			m.fetchOutside(OutsideHead)
		}
		m.prefetch(i + 2)
	}
	if len(m.Blocks) == 0 {
		m.fetchOutside(OutsideHead)
	}
	if !backward {
		return
	}
	m.outsideGradsDone(OutsideHead)
	for i := len(m.Blocks) - 1; i >= 0; i-- {
		m.fetch(i)
		m.prefetch(i - 1)
		m.gradsDone(i)
	}
	m.outsideGradsDone(OutsideEmbed)
}
