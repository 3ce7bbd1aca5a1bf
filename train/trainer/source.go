package trainer

import (
	"io"
	"time"

	"distill/cache"
	"distill/data/tokenizer"
	"distill/model"
	"distill/train"
)

// Source is where a run's samples and their targets come from: a
// teacher's cache (data.cache), several teachers' caches (data.caches), a
// dataset with no teacher (data.dataset), or a dataset with live teachers
// (distill.teachers). It is the one part of the trainer that knows where
// samples come from. The run asks it for each step's packed rows with
// their teachers' top-k (Batches), and for the held-out rows of an eval
// (EvalRows); a checkpoint stores the data position its Batches report,
// from which a resumed run asks it to start again.
//
// The run calls Open once the student is built (or loaded), then Check
// and, when the config holds samples out, CheckEval, all before step 1;
// then Batches (the training order; QAD's calibration opens its own at
// the start) and EvalRows as often as it needs, and Close as it ends.
// Options.Source replaces the config's data with any implementation.
type Source interface {
	// Open readies the source for the student (a dataset is opened with
	// the student's tokenizer, live teachers are dialed and their Info
	// checked) and describes its data.
	Open(p SourceParams) (SourceInfo, error)
	// Check refuses data the student cannot train on: another
	// vocabulary or tokenizer.
	Check(p SourceParams) error
	// CheckEval refuses a held-out range that an eval could not read
	// whole (samples not filled yet).
	CheckEval(r cache.Range) error
	// Batches starts the training order at a data position (epoch,
	// position in the epoch's order; 0, 0 for a new run), never
	// yielding a sample of held.
	Batches(held cache.Range, epoch int, pos int64) (Batches, error)
	// EvalRows packs samples [r.Start, r.End) in index order into rows
	// with their targets, and says how many samples they hold.
	EvalRows(r cache.Range) (rows []*train.Batch, samples int, err error)
	// Close releases what Open took; the run calls it even when Open
	// failed.
	Close()
}

// Batches is a source's training order from a data position: one step's
// packed rows at a time.
type Batches interface {
	// Next packs the next samples of the order, at least tokens tokens of
	// them, into rows of at most data.seq_len tokens (a sample is never
	// split), each with its teachers' top-k.
	Next(tokens int) ([]*train.Batch, error)
	// Position is the data position after the rows Next returned last:
	// what a checkpoint stores to resume there.
	Position() (epoch int, pos int64)
	Close()
}

// SourceParams is what a source is opened and checked for: the student.
type SourceParams struct {
	Student *model.Config
	// TokenizerFingerprint is the student's tokenizer; Tokenizer and
	// TokenizerDir are nil and "" when only its fingerprint is known.
	TokenizerFingerprint string
	Tokenizer            *tokenizer.Tokenizer
	TokenizerDir         string
	// Log receives the source's lines (what it opened, its teachers).
	Log io.Writer
}

// SourceInfo describes a source's data to the run.
type SourceInfo struct {
	// Manifest describes the data as a cache of it would: the teacher and
	// dataset fingerprints (a checkpoint records them; a resume must
	// match), the sample count (data.eval_range must lie inside), k and
	// the capture temperature (the loss's teacher temperature).
	Manifest cache.Manifest
	// Kind names the data in messages ("cache", "dataset").
	Kind string
	// NoTeacher: there is no teacher (SFT): the loss is the CE alone, at
	// distill.temperature, and the log lines show no KD.
	NoTeacher bool
	// Teachers of multi-teacher KD in order, as checkpoints record them
	// (nil with one teacher or none); TeachersFrom is the config key
	// that lists them and Where(i) names teacher i, for messages.
	Teachers     []TeacherState
	TeachersFrom string
	Where        func(int) string
	// K is the widest top-k of a position the loss head takes (the
	// memory plan's): the sum of the teachers' with several caches.
	K int
	// ChatTemplate is the template the samples were rendered with when
	// it overrides the tokenizer's; checkpoints carry it to export.
	ChatTemplate string
}

// newSource opens the data the config names. A cache is opened now, so
// that a missing one fails before anything is written; a dataset is
// opened by Open, once the student's tokenizer is known.
func newSource(cfg *Config, log io.Writer) (Source, error) {
	if len(cfg.Data.Caches) > 0 || cfg.Data.Dataset == nil {
		c, err := openCacheSource(cfg, log)
		if err != nil {
			return nil, err
		}
		return c, nil
	}
	d, err := newDatasetSource(cfg)
	if err != nil {
		return nil, err
	}
	if cfg.online() {
		return &onlineSource{datasetSource: d, cfg: cfg}, nil
	}
	return d, nil
}

// summarizer is a source with a line to say when training ends (what a
// dataset's tokenization did).
type summarizer interface {
	summary() string
}

// teacherWaiter is a training order that waits for live teachers: how
// long it waited since the last call, and the samples queued ahead.
type teacherWaiter interface {
	teacherWait() (time.Duration, int)
}

// packedBatches is Batches over a stream of samples, packed by a packer:
// the built-in sources' training order.
type packedBatches struct {
	st sampleStream
	pk *packer
}

func (b *packedBatches) Next(tokens int) ([]*train.Batch, error) { return b.pk.nextStep(b.st, tokens) }
func (b *packedBatches) Position() (int, int64)                  { return b.st.position() }
func (b *packedBatches) Close()                                  { b.st.close() }

// teacherWait is the online stream's wait for its teachers (0 for a
// cache or a dataset, which have none to wait for).
func (b *packedBatches) teacherWait() (time.Duration, int) {
	if ost, ok := b.st.(*onlineStream); ok {
		return ost.stats()
	}
	return 0, 0
}
