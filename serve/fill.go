package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	"distill/internal/stall"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// ErrFill marks (errors.Is) a fill the driver could not complete; the
// message says which teacher, chunk or check failed and what to do. Its
// own text is not in the message: the command that runs the fill names it
// ("cachectl fill: teacher a:7070: ..."), and a "fill: " of the driver's
// after that said it twice ("cachectl fill: fill: teacher a:7070: ...").
var ErrFill = errors.New("fill")

// fillError is an ErrFill whose message is err's alone.
type fillError struct{ err error }

func (e *fillError) Error() string        { return e.err.Error() }
func (e *fillError) Unwrap() error        { return e.err }
func (e *fillError) Is(target error) bool { return target == ErrFill }

// FillPlan is what `cachectl fill` asks for.
type FillPlan struct {
	// Dataset is read by every teacher with its own files and tokenizer.
	Dataset *pb.Dataset
	// Start and End bound the samples; End 0 means the dataset's length.
	Start, End int64
	// ChunkSamples is the unit of work and of crash recovery (default 256).
	ChunkSamples int64
	// K, Temperature and Encoding of the cache (0/"" : the daemons' defaults).
	// Targets and Samples are the target kind and its draws per position
	// (FillRequest.targets, .samples; "" is topk).
	Targets     string
	Samples     int32
	K           int32
	Temperature float32
	Encoding    string
	// TokenizerFingerprint, when set, must equal the teachers' tokenizer.
	TokenizerFingerprint string
	// PerWorker is the chunks in flight per teacher (default 2).
	PerWorker int
	// RetryFor is how long an unreachable teacher, or one not serving
	// yet (loading its model), is retried before the driver gives up on
	// it (default 2m; negative: not at all). Its chunks go to the others.
	// At the start, the fill waits this long for a first teacher to
	// answer; the others join when they answer, until RetryFor after the
	// start.
	RetryFor time.Duration
	// MaxChunkFailures aborts the fill when one chunk failed this often
	// (default 5).
	MaxChunkFailures int
	// BusyPoll is how long a chunk that another writer of the cache is
	// computing (another cachectl fill, another daemon on the directory)
	// waits before it is asked for again (default 5s). The other chunks go
	// first: two fills of one range split its chunks.
	BusyPoll time.Duration
	// BusyRepeat is how often a chunk still busy is said again (default
	// 1m): a fill left waiting for another writer says what it waits for.
	BusyRepeat time.Duration
	// StallTimeout bounds how long a teacher's call for a chunk may send
	// nothing, neither the chunk's report nor a progress message, before
	// it is cancelled and the teacher treated as failed, as one that died
	// (its chunk goes to the others): a daemon whose forward pass hangs
	// while it answers keepalive pings held its chunks for ever. A daemon
	// sends progress after every forward pass, so the timeout is no
	// bound on a chunk; an older daemon sends none, and it then bounds
	// each chunk. 0: stall.DefaultTimeout (10m); negative: no watchdog.
	StallTimeout time.Duration
	// Out receives progress and the summary (nil: none). Terminal draws a
	// progress bar; otherwise a log line every LogEvery (default 10s).
	Out      io.Writer
	Terminal bool
	LogEvery time.Duration
	// onChunk is called after each chunk a worker reports, from the
	// workers' goroutines concurrently (tests).
	onChunk func(w Worker, r *pb.FillResponse)
	// onProgress is called after each progress message a worker sends,
	// once the stall watchdog has heard it (tests); stallClock is the
	// clock of a worker's watchdogs (tests; nil: the real one).
	onProgress func(w Worker, p *pb.Progress)
	stallClock func(w Worker) stall.Clock
	// now and after replace time.Now and time.After where the fill
	// waits for its teachers (tests; nil: the real clock).
	now   func() time.Time
	after func(time.Duration) <-chan time.Time
}

// FillSummary is what a fill did.
type FillSummary struct {
	// Samples and Tokens computed in this run (skipped chunks excluded).
	Samples, Tokens int64
	// Targets are the positions of those samples training learns from
	// (loss mask 1). Truncated samples were cut to max_len; Dropped and
	// BadSkipped ones are stored empty (no target within max_len, over
	// max_len under policy drop, or a bad record under skip_bad), with
	// their counts per reason and the first few messages in Examples.
	Targets                        int64
	Truncated, Dropped, BadSkipped int64
	Reasons                        map[string]int64
	Examples                       []string
	// examples are every chunk's messages with its start, so that the
	// printed ones are the first in sample order, not in arrival order.
	examples []fillExample
	// Chunks computed and Skipped (already in a cache) in this run, and
	// ByOthers: chunks another writer of a cache was computing when this
	// fill came to them, and committed (this fill waited for them).
	Chunks, Skipped, ByOthers int
	// Retries counts chunks handed out again after a teacher failed.
	Retries int
	// Elapsed is the wall time of the run, from when a first teacher
	// answered; Waited the part of it when none answered (all failing,
	// retried), which the rate leaves out.
	Elapsed, Waited time.Duration
	// Dirs maps each cache directory to the teachers writing it; read
	// them together (cache.OpenReader(dirs...)).
	Dirs map[string][]string
	// DatasetFingerprint and DatasetSamples describe the dataset.
	DatasetFingerprint string
	DatasetSamples     int64
}

// fillErr is an ErrFill of fmt.Errorf(format, a...) (%w wraps as there).
func fillErr(format string, a ...any) error { return &fillError{fmt.Errorf(format, a...)} }

// msg is err's message as a user reads it (teacherdial.Message): the
// daemon's, or what happened to a connection that failed.
func msg(err error) string { return teacherdial.Message(err) }

// permanent reports whether a failed Fill would fail again anywhere: the
// request or the data is wrong, not the teacher's health. Every error of
// the in-process teacher is: it is the only teacher and runs in this
// process, so no retry or other teacher can do better (its Internal errors
// are the cache directory's or the machine's, e.g. a full disk).
func permanent(w Worker, err error) bool {
	if isLocal(w) {
		return true
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.NotFound, codes.OutOfRange,
		codes.Unauthenticated, codes.PermissionDenied, codes.Unimplemented, codes.AlreadyExists:
		return true
	}
	return false
}

// isLocal reports whether w is the in-process teacher (Local).
func isLocal(w Worker) bool {
	_, ok := w.(*local)
	return ok
}

// failure says what went wrong with w in an error message: the teacher
// and the gRPC code for a daemon, only the message in-process (where
// there is one teacher, and the user is its operator).
// what "" names nothing beside the teacher (the message names it).
func failure(w Worker, what string, err error) string {
	switch {
	case isLocal(w) && what == "":
		return msg(err)
	case isLocal(w):
		return fmt.Sprintf("%s: %s", what, msg(err))
	case what == "":
		return fmt.Sprintf("teacher %s: %s: %s", w.Name(), status.Code(err), msg(err))
	}
	return fmt.Sprintf("teacher %s, %s: %s: %s", w.Name(), what, status.Code(err), msg(err))
}

// RunFill fills [Start, End) of the dataset through the workers over
// disjoint chunks. Before any work it checks that the teachers agree with
// each other (teacher, vocab size, tokenizer) and on the dataset (length,
// fingerprint); it asks every teacher which ranges its cache already holds
// and hands out only the missing chunks, so a re-run resumes and an
// interrupted chunk is redone. A teacher that fails is retried for
// RetryFor while the others take over its chunks. At the end it checks
// that every sample of the range is covered, by one chunk or by identical
// copies of it (see combine).
func RunFill(ctx context.Context, workers []Worker, p FillPlan) (*FillSummary, error) {
	if err := p.setDefaults(len(workers)); err != nil {
		return nil, err
	}
	sum := &FillSummary{Dirs: map[string][]string{}, Reasons: map[string]int64{}}

	// 1. The teachers agree with each other and with the dataset. Those
	// that do not answer yet join later (fillDispatch.join).
	answers, waits, err := p.startTeachers(ctx, workers)
	if err != nil {
		return nil, err
	}
	// The run's time, and its rate, start when a teacher answers: a
	// wait for a daemon loading its model is no work.
	t0 := p.timeNow()
	ref, err := p.agree(workers, answers)
	if err != nil {
		return nil, err
	}
	var live []Worker
	for i, w := range workers {
		if answers[i] != nil {
			live = append(live, w)
		}
	}
	n, fp := answers[ref].desc.GetSamples(), answers[ref].desc.GetFingerprint()
	sum.DatasetFingerprint, sum.DatasetSamples = fp, n
	if err := p.setRange(n); err != nil {
		return nil, err
	}
	dirs := newFillDirs(workers, answers, sum)

	// 2. What is done already, in any of the directories.
	todo, already, err := p.chunksToDo(ctx, live, dirs, fp, sum)
	if err != nil {
		return nil, err
	}

	// 3. Hand out the chunks.
	d := newFillDispatch(&p, dirs, fp, sum, todo)
	d.ref, d.refAnswer, d.up, d.start = workers[ref], answers[ref], len(live), t0
	for i, w := range workers {
		if answers[i] == nil {
			d.lastErr[w.Name()] = fmt.Sprintf("%s: %s", status.Code(waits[i].(*askError).err), waits[i])
		}
	}
	stopProgress := startProgress(&p, p.End-p.Start, already, &d.samples, &d.tokens, t0, d.waiting)
	err = d.run(ctx, workers, answers)
	stopProgress()
	sum.Elapsed = time.Since(t0)
	_, _, sum.Waited = d.waiting()
	if err != nil {
		return sum, err
	}

	// 4. Every sample of the range is in exactly one directory.
	if err := p.checkCovered(workers, dirs, fp); err != nil {
		return sum, err
	}
	if p.Out != nil {
		sum.print(p.Out)
	}
	if sum.Samples > 0 && sum.Targets == 0 {
		return sum, fillErr("every one of the %d samples filled is empty (%s): the cache holds nothing to train on. "+
			"Check the dataset options (raise --max-len, set --columns or --roles to your field names, drop --skip-bad to see the first bad record), "+
			"then fill into a new cache directory: this one is bound to the dataset as read now", sum.Samples, sum.countsLine())
	}
	return sum, nil
}

// setDefaults fills in the plan's defaults and checks what can be checked
// before asking any teacher.
func (p *FillPlan) setDefaults(workers int) error {
	if workers == 0 {
		return fillErr("no teacher: give --teacher ADDR[,ADDR...] or --model DIR")
	}
	if p.ChunkSamples == 0 {
		p.ChunkSamples = DefaultChunkSamples
	}
	if p.ChunkSamples < 0 || p.ChunkSamples > cache.MaxChunkSamples {
		return fillErr("--chunk %d: want 1..%d", p.ChunkSamples, cache.MaxChunkSamples)
	}
	if p.PerWorker <= 0 {
		p.PerWorker = 2
	}
	if p.RetryFor == 0 {
		p.RetryFor = 2 * time.Minute
	}
	if p.MaxChunkFailures == 0 {
		p.MaxChunkFailures = 5
	}
	if p.BusyPoll == 0 {
		p.BusyPoll = 5 * time.Second
	}
	if p.BusyRepeat == 0 {
		p.BusyRepeat = time.Minute
	}
	if p.LogEvery == 0 {
		p.LogEvery = 10 * time.Second
	}
	if p.StallTimeout == 0 {
		p.StallTimeout = stall.DefaultTimeout
	}
	if err := ValidateDataset(p.Dataset); err != nil {
		return fillErr("%s", msg(err))
	}
	return nil
}

// teacherAnswer is what a teacher said before it takes chunks: what it
// runs (Info) and how it reads the dataset (Describe).
type teacherAnswer struct {
	info *pb.InfoResponse
	desc *pb.DescribeDatasetResponse
}

// askTimeout bounds one Info or Describe of a teacher being waited for:
// an address that drops packets would hold the wait on one call.
const askTimeout = 10 * time.Second

// ask asks w what it runs and how it reads the dataset. With wait set,
// w did not answer and waiting may cure it (wait is its error, for the
// user); err is a refusal or an answer no wait can change (a wrong token,
// no cache directory, a dataset it cannot read), an ErrFill that says
// what to fix.
func (p *FillPlan) ask(ctx context.Context, w Worker) (a teacherAnswer, wait, err error) {
	cctx, cancel := context.WithTimeout(ctx, askTimeout)
	defer cancel()
	if a.info, err = w.Info(cctx); err != nil {
		if ctx.Err() == nil && waitable(w, err) {
			return a, &askError{"Info", err}, nil
		}
		// A daemon that refuses the token is running: "is it
		// running?" sent the user to check the wrong thing.
		hint := "is it running? check the address, --token and TLS"
		if c := status.Code(err); c == codes.Unauthenticated || c == codes.PermissionDenied {
			hint = "give the daemon's bearer token with --token-file, --token or $DISTILL_TOKEN"
		}
		return a, nil, fillErr("teacher %s: Info: %s (%s)", w.Name(), msg(err), hint)
	}
	if a.info.GetCacheDir() == "" {
		return a, nil, fillErr("teacher %s has no cache directory: start it with --cache DIR", w.Name())
	}
	if a.desc, err = w.Describe(cctx, p.Dataset); err != nil {
		if ctx.Err() == nil && waitable(w, err) {
			return a, &askError{"dataset", err}, nil
		}
		return a, nil, fillErr("%s", failure(w, "dataset", err))
	}
	return a, nil, nil
}

// askError is a call to a teacher that waiting may cure.
type askError struct {
	call string // "Info", "dataset"
	err  error
}

func (e *askError) Error() string { return e.call + ": " + msg(e.err) }

// waitable reports whether a daemon's failed call may succeed later: it
// could not be reached (not started yet, restarting, the network), or
// it is not serving yet (loading its model: Unavailable while its health
// says NOT_SERVING) or any more (draining). A daemon that answered and
// refused (a wrong token, TLS it cannot speak, a request it rejects) is
// not waited for: waiting cannot fix it.
func waitable(w Worker, err error) bool {
	if isLocal(w) {
		return false
	}
	switch status.Code(err) {
	case codes.Unavailable:
		// A TLS handshake that fails is the client's or the daemon's
		// certificates, not the daemon's health.
		return !strings.Contains(status.Convert(err).Message(), "authentication handshake failed")
	case codes.DeadlineExceeded: // askTimeout, the caller's context alive
		return true
	}
	return false
}

// waitHint says what to check of a teacher that did not answer in time.
func waitHint(wait error) string {
	if strings.Contains(wait.Error(), "still loading") {
		return "still loading its model: give a longer --retry-for"
	}
	return "is it running? check the address, --token and TLS"
}

// startTeachers asks every teacher what it runs and how it reads the
// dataset, and returns the answers of those that answered (nil for the
// others) and why the others did not. Teachers that cannot be reached or
// are not serving yet (loading the model) are waited for, up to
// RetryFor, until one answers: a fill started beside its daemons (one
// Slurm job) starts when the first has loaded. The wait is said at once
// and again every LogEvery, with what each teacher last answered. The
// teachers that have not answered when one does join the fill when they
// answer (fillDispatch.join). A teacher that refuses fails the fill at
// once; with no answer in RetryFor, the fill fails naming every teacher
// and why.
func (p *FillPlan) startTeachers(ctx context.Context, workers []Worker) ([]*teacherAnswer, []error, error) {
	answers := make([]*teacherAnswer, len(workers))
	waits := make([]error, len(workers))
	t0 := p.timeNow()
	var said time.Time // when the wait was last said
	for {
		for i, w := range workers {
			if answers[i] != nil {
				continue
			}
			a, wait, err := p.ask(ctx, w)
			if err != nil {
				return nil, nil, err
			}
			if waits[i] = wait; wait == nil {
				answers[i] = &a
			}
		}
		var none []string // the teachers that did not answer, and why
		for i, w := range workers {
			if waits[i] != nil {
				none = append(none, w.Name()+": "+waits[i].Error())
			}
		}
		now := p.timeNow()
		waited := now.Sub(t0)
		if len(none) < len(workers) {
			if !said.IsZero() && p.Out != nil {
				for i, w := range workers {
					if answers[i] != nil {
						fmt.Fprintf(p.Out, "fill: teacher %s answers (after %s of waiting)\n", w.Name(), roundDuration(waited))
					}
				}
			}
			if len(none) > 0 && p.Out != nil {
				fmt.Fprintf(p.Out, "fill: starting without %s; each joins the fill when it answers (until %s since the start, --retry-for)\n",
					strings.Join(none, "; "), p.RetryFor)
			}
			return answers, waits, nil
		}
		if waited >= p.RetryFor {
			why := make([]string, len(workers))
			for i, w := range workers {
				why[i] = fmt.Sprintf("teacher %s: %s (%s)", w.Name(), waits[i], waitHint(waits[i]))
			}
			if p.RetryFor <= 0 {
				return nil, nil, fillErr("%s", strings.Join(why, "; "))
			}
			return nil, nil, fillErr("no teacher answered in %s (--retry-for): %s", p.RetryFor, strings.Join(why, "; "))
		}
		if p.Out != nil {
			switch {
			case said.IsZero():
				fmt.Fprintf(p.Out, "fill: waiting for the teachers to answer (for up to %s, --retry-for): %s\n", p.RetryFor, strings.Join(none, "; "))
				said = now
			case now.Sub(said) >= p.LogEvery:
				fmt.Fprintf(p.Out, "fill: still waiting for the teachers (%s of %s, --retry-for): %s\n", roundDuration(waited), p.RetryFor, strings.Join(none, "; "))
				said = now
			}
		}
		select {
		case <-p.timeAfter(loadingPoll):
		case <-ctx.Done():
			return nil, nil, fillErr("interrupted (%v) while waiting for the teachers to answer", context.Cause(ctx))
		}
	}
}

// loadingPoll is how often a teacher that does not answer is asked again.
const loadingPoll = 500 * time.Millisecond

// timeNow and timeAfter are time.Now and time.After, or the test's clock.
func (p *FillPlan) timeNow() time.Time {
	if p.now != nil {
		return p.now()
	}
	return time.Now()
}

func (p *FillPlan) timeAfter(d time.Duration) <-chan time.Time {
	if p.after != nil {
		return p.after(d)
	}
	return time.After(d)
}

// agree checks that the teachers that answered agree with each other
// (checkpoint, vocabulary, tokenizer, dataset) and with the plan's
// tokenizer, and pins the plan's k. The first that answered is ref, the
// one late teachers are checked against (disagree).
func (p *FillPlan) agree(workers []Worker, answers []*teacherAnswer) (ref int, err error) {
	ref = -1
	for i := range workers {
		if answers[i] == nil {
			continue
		}
		if ref < 0 {
			ref = i
			continue
		}
		if err := disagree(workers[ref], answers[ref], workers[i], answers[i]); err != nil {
			return ref, err
		}
	}
	a := answers[ref].info
	if p.K == 0 {
		// Each teacher would use its own --k-default: they must agree, and
		// the k is pinned so that every chunk of this run gets the same.
		for i := range workers {
			if answers[i] == nil {
				continue
			}
			if x, y := a.GetKDefault(), answers[i].info.GetKDefault(); x != y {
				return ref, fillErr("teachers disagree on the default k (teacherd --k-default): %d on %s, %d on %s; give --k or start them alike",
					x, workers[ref].Name(), y, workers[i].Name())
			}
		}
		p.K = a.GetKDefault()
	}
	if fp := answers[ref].desc.GetTokenizerFingerprint(); p.TokenizerFingerprint != "" && !p.Dataset.GetPretokenized() && p.TokenizerFingerprint != fp {
		return ref, fillErr("tokenizer mismatch: --tokenizer has fingerprint %.16s, teacher %s tokenizes with %.16s; give the daemon the same tokenizer (teacherd --tokenizer)",
			p.TokenizerFingerprint, workers[ref].Name(), fp)
	}
	return ref, nil
}

// disagree is the error of teacher y whose answer differs from x's in
// what the teachers of one fill must share (checkpoint, vocabulary,
// tokenizer, dataset), nil if none does.
func disagree(wx Worker, x *teacherAnswer, wy Worker, y *teacherAnswer) error {
	if name, xv, yv := differ(x, y); name != "" {
		return fillErr("teachers disagree on the %s: %v on %s, %v on %s; every teacher must run the same checkpoint, tokenizer and dataset files",
			name, xv, wx.Name(), yv, wy.Name())
	}
	return nil
}

// differ is the first of what the teachers of one fill must share
// (checkpoint, vocabulary, tokenizer, dataset) in which answers x and y
// differ, and its two values; "" if none.
func differ(x, y *teacherAnswer) (name string, xv, yv any) {
	for _, f := range []struct {
		name string
		x, y any
	}{
		{"teacher fingerprint (checkpoint)", x.info.GetTeacherFingerprint(), y.info.GetTeacherFingerprint()},
		{"vocab size", x.info.GetVocabSize(), y.info.GetVocabSize()},
		{"tokenizer fingerprint", x.desc.GetTokenizerFingerprint(), y.desc.GetTokenizerFingerprint()},
		{"dataset samples", x.desc.GetSamples(), y.desc.GetSamples()},
		{"dataset fingerprint (files, tokenizer, options)", x.desc.GetFingerprint(), y.desc.GetFingerprint()},
	} {
		if f.x != f.y {
			return f.name, f.x, f.y
		}
	}
	return "", nil, nil
}

// setRange resolves End 0 to the dataset's n samples and checks the range.
func (p *FillPlan) setRange(n int64) error {
	if p.Start >= n {
		// With --end 0 this said "range [20, 20): want 0 <= start <
		// end", and with an --end past it "lower --end": the start is
		// what is out of range.
		if n == 0 {
			return fillErr("--start %d: the dataset has no samples", p.Start)
		}
		return fillErr("--start %d: the dataset has %d samples (0 to %d); give a --start below %d", p.Start, n, n-1, n)
	}
	if p.End == 0 {
		p.End = n
	}
	if p.Start < 0 || p.Start >= p.End {
		return fillErr("range [%d, %d): want 0 <= start < end", p.Start, p.End)
	}
	if p.End > n {
		return fillErr("range [%d, %d) goes beyond the dataset's %d samples: lower --end", p.Start, p.End, n)
	}
	return nil
}

// fillDirs are the teachers' cache directories. Each teacher's view of its
// directory is a key of its own: the same path on two machines (--cache
// /data/cache on every node) is two caches; two teachers sharing one
// directory on one machine report the same chunks, which combine merges
// silently (same path).
type fillDirs struct {
	of     map[Worker]string        // a teacher's directory key
	pathOf map[string]string        // a key's path, as its teacher reported it
	byDir  map[string][]cache.Range // a key's committed ranges, and those reported during the fill
	moved  map[string]string        // a key whose teacher writes another directory now: that directory
}

// newFillDirs keys the directories of the teachers that answered (nil
// for the others, added when they join) and lists them in sum.Dirs.
func newFillDirs(workers []Worker, answers []*teacherAnswer, sum *FillSummary) *fillDirs {
	dirs := &fillDirs{of: map[Worker]string{}, pathOf: map[string]string{}, moved: map[string]string{}}
	for i, w := range workers {
		if answers[i] != nil {
			dirs.add(w, answers[i].info.GetCacheDir(), sum)
		}
	}
	return dirs
}

// add keys w's directory d and lists it in sum.Dirs.
func (dirs *fillDirs) add(w Worker, d string, sum *FillSummary) string {
	key := d + " on " + w.Name()
	if isLocal(w) {
		key = d
	}
	dirs.of[w], dirs.pathOf[key] = key, d
	if !slices.Contains(sum.Dirs[d], w.Name()) { // a teacher back in a directory it wrote before (recheck)
		sum.Dirs[d] = append(sum.Dirs[d], w.Name())
	}
	return key
}

// chunksToDo asks the teachers what their directories hold of dataset fp,
// checks that the directories can be read together and hold it as the
// plan asks, and splits what is missing of the range into chunks. already
// is the samples of the range done before; sum.Skipped counts their chunks.
func (p *FillPlan) chunksToDo(ctx context.Context, workers []Worker, dirs *fillDirs, fp string, sum *FillSummary) (todo []cache.Range, already int64, err error) {
	if dirs.byDir, err = dirRanges(ctx, workers, dirs.of, fp, false); err != nil {
		return nil, 0, err
	}
	done, _, err := combine(dirs.byDir, dirs.pathOf)
	if err != nil {
		return nil, 0, err
	}
	if err := p.probe(ctx, workers, dirs, fp); err != nil {
		return nil, 0, err
	}
	for _, g := range cache.MissingOf(done, cache.Range{Start: p.Start, End: p.End}) {
		for a := g.Start; a < g.End; a += p.ChunkSamples {
			todo = append(todo, cache.Range{Start: a, End: min(a+p.ChunkSamples, g.End)})
		}
	}
	for _, r := range done {
		if in := min(r.End, p.End) - max(r.Start, p.Start); in > 0 {
			already += in
			sum.Skipped++
		}
	}
	return todo, already, nil
}

// probe fills one done chunk of each directory again. Status knows the
// dataset only: a directory holding it with another k, temperature or
// encoding would pass for done. A Fill of one of its done chunks costs
// nothing and checks the directory's manifest against this request.
func (p *FillPlan) probe(ctx context.Context, workers []Worker, dirs *fillDirs, fp string) error {
	probed := map[string]bool{}
	for _, w := range workers {
		d := dirs.of[w]
		if rs := dirs.byDir[d]; len(rs) > 0 && !probed[d] {
			probed[d] = true
			err := w.Fill(ctx, p.request(fp, rs[0]), func(*pb.FillResponse) error { return nil })
			if err != nil {
				// A manifest mismatch names the directory itself: "cache
				// DIR: cache: manifest mismatch: ... 4 in DIR" said it
				// twice, and cache twice.
				what := "cache " + d
				if strings.Contains(msg(err), dirs.pathOf[d]) {
					what = ""
				}
				return fillErr("%s", failure(w, what, err))
			}
		}
	}
	return nil
}

// request is the Fill of chunk r of dataset fp under the plan.
func (p *FillPlan) request(fp string, r cache.Range) *pb.FillRequest {
	return &pb.FillRequest{Dataset: p.Dataset, Start: r.Start, End: r.End, ChunkSamples: r.Len(),
		K: optK(p.K), Temperature: p.Temperature, Encoding: p.Encoding, ExpectDatasetFingerprint: fp,
		Targets: p.Targets, Samples: p.Samples, Progress: true}
}

// checkCovered checks that every sample of the range is in exactly one
// directory: it asks the teachers again; for one that is gone, it uses
// what the teacher reported. A chunk in two directories is no error, and
// is reported on p.Out.
func (p *FillPlan) checkCovered(workers []Worker, dirs *fillDirs, fp string) error {
	fresh, err := dirRanges(context.Background(), workers, dirs.of, fp, true)
	if err != nil {
		return err
	}
	for d, rs := range fresh {
		dirs.byDir[d] = rs
	}
	for d := range dirs.byDir {
		if _, ok := fresh[d]; ok || p.Out == nil {
			continue
		}
		if to, ok := dirs.moved[d]; ok {
			fmt.Fprintf(p.Out, "fill: %s: checked with the chunks its teacher reported before it moved to %s\n", d, to)
			continue
		}
		fmt.Fprintf(p.Out, "fill: the teacher of %s is unreachable now; checked with the chunks it reported\n", d)
	}
	done, dups, err := combine(dirs.byDir, dirs.pathOf)
	if err != nil {
		return err
	}
	for _, d := range dups {
		// Not an error: readers of the directories as one cache use one copy.
		if p.Out != nil {
			fmt.Fprintf(p.Out, "fill: chunk %s: a teacher committed it and died before reporting (or its Fill failed after reporting), and it was redone; the summary counts it once, readers use one copy, and the other can be deleted with its chunk file\n", d)
		}
	}
	if gaps := cache.MissingOf(done, cache.Range{Start: p.Start, End: p.End}); len(gaps) > 0 {
		parts := make([]string, len(gaps))
		for i, g := range gaps {
			parts[i] = g.String()
		}
		return fillErr("after the fill, samples %s are still missing from the caches; re-run to fill them", strings.Join(parts, ", "))
	}
	return nil
}

// print writes the summary: what was computed, the counts, and where the
// cache directories are.
func (s *FillSummary) print(w io.Writer) {
	// The rate is over the time some teacher answered, as the progress
	// line's: a wait for a teacher to come back computes nothing.
	rate := fmt.Sprintf("%.0f tokens/s", float64(s.Tokens)/(s.Elapsed-s.Waited).Seconds())
	if s.Waited > 0 {
		rate += fmt.Sprintf(" over the %s a teacher answered; %s waiting for one", roundDuration(s.Elapsed-s.Waited), roundDuration(s.Waited))
	}
	fmt.Fprintf(w, "fill: %d samples, %d tokens, %d targets in %d chunks in %s (%s); %d chunks were already done; %d retries\n",
		s.Samples, s.Tokens, s.Targets, s.Chunks, s.Elapsed.Round(time.Millisecond), rate, s.Skipped, s.Retries)
	s.printCounts(w)
	dirs := make([]string, 0, len(s.Dirs))
	for d := range s.Dirs {
		dirs = append(dirs, d)
	}
	sort.Strings(dirs)
	for _, d := range dirs {
		fmt.Fprintf(w, "fill: cache directory %s (written by %s)\n", d, strings.Join(s.Dirs[d], ", "))
	}
	if len(dirs) > 1 {
		// Each directory is a --cache: `cachectl verify DIR DIR`, printed
		// here once, exits 2 (unexpected arguments).
		fmt.Fprintf(w, "fill: read the directories together as one cache (cachectl verify --cache %s; student train --cache %s)\n",
			strings.Join(dirs, " --cache "), strings.Join(dirs, ","))
	}
	if s.ByOthers > 0 {
		fmt.Fprintf(w, "fill: %d chunks were computed by another writer of the cache meanwhile (not counted above)\n", s.ByOthers)
	}
}

// fillDispatch hands a fill's chunks to the teachers, PerWorker goroutines
// each, and counts what they report. A chunk whose teacher failed goes
// back to the queue for any teacher; the teacher backs off, and is given
// up on after failing for RetryFor.
type fillDispatch struct {
	p      *FillPlan
	fp     string
	dirs   *fillDirs
	sum    *FillSummary
	queue  chan cache.Range
	cancel context.CancelFunc

	remaining, samples, tokens, retries, chunks atomic.Int64

	mu       sync.Mutex // guards what follows, dirs.byDir and sum's counts
	failures map[cache.Range]int
	counted  map[cache.Range]bool // chunks in the summary: a redone one counts once
	// stallAt is the Status of a teacher when it stalled (by name): it
	// gets a chunk again once a forward pass has completed on it since
	// (stall.Mended), as its Info, which a hung daemon answers, says
	// nothing.
	stallAt map[string]*pb.StatusResponse
	fatal   error
	lastErr map[string]string // a teacher's last error
	gaveUp  map[string]bool   // teachers given up on (said once)
	// busyAt: when a chunk was last found busy (another writer computes
	// it); it is asked for again BusyPoll after that. busySaid: when that
	// was last said.
	busyAt, busySaid map[cache.Range]time.Time
	now              func() time.Time // time.Now; tests set a clock of their own
	// up counts the teachers answering (not failing, joined); waitSince
	// is when the last of them failed, while up is 0. waited sums the
	// waits that have ended: the progress leaves them out of the rate.
	up        int
	waitSince time.Time
	waited    time.Duration

	// ref and refAnswer are the teacher a late one is checked against
	// (the first that answered), start when the fill started: a teacher
	// that has not answered RetryFor after it is given up on.
	ref       Worker
	refAnswer *teacherAnswer
	start     time.Time
}

func newFillDispatch(p *FillPlan, dirs *fillDirs, fp string, sum *FillSummary, todo []cache.Range) *fillDispatch {
	d := &fillDispatch{p: p, fp: fp, dirs: dirs, sum: sum, queue: make(chan cache.Range, len(todo)),
		failures: map[cache.Range]int{}, counted: map[cache.Range]bool{}, stallAt: map[string]*pb.StatusResponse{}, lastErr: map[string]string{}, gaveUp: map[string]bool{},
		busyAt: map[cache.Range]time.Time{}, busySaid: map[cache.Range]time.Time{}, now: p.timeNow}
	for _, r := range todo {
		d.queue <- r
	}
	d.remaining.Store(int64(len(todo)))
	return d
}

// run fills the queued chunks and sets the summary's totals; a teacher
// with no answer (nil: it did not answer at the start) works once it has
// joined. Its error says why chunks are left: a chunk that cannot be
// done, the caller's context, or no teacher left to take them.
func (d *fillDispatch) run(ctx context.Context, workers []Worker, answers []*teacherAnswer) error {
	ctx, d.cancel = context.WithCancel(ctx)
	defer d.cancel()
	var wg sync.WaitGroup
	if d.remaining.Load() > 0 {
		for i, w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if answers[i] == nil && !d.join(ctx, w) {
					return
				}
				down := new(atomic.Int64) // unix nanos since the worker is failing, 0: up
				for range d.p.PerWorker {
					wg.Add(1)
					go func() {
						defer wg.Done()
						d.work(ctx, w, down)
					}()
				}
			}()
		}
	}
	wg.Wait()
	d.sum.Samples, d.sum.Tokens, d.sum.Chunks, d.sum.Retries = d.samples.Load(), d.tokens.Load(), int(d.chunks.Load()), int(d.retries.Load())
	return d.result(ctx)
}

// work is one of w's goroutines: it fills chunks from the queue until
// none is left, the fill is aborted, or w is given up on.
func (d *fillDispatch) work(ctx context.Context, w Worker, down *atomic.Int64) {
	backoff := 200 * time.Millisecond
	for {
		var r cache.Range
		select {
		case r = <-d.queue:
		case <-ctx.Done():
			return
		}
		if !d.waitBusy(ctx, r) {
			return
		}
		called := time.Now().UnixNano()
		var err error
		if down.Load() != 0 {
			// w failed: it may have been restarted since, with another
			// checkpoint or cache directory. Asked again before it gets
			// a chunk.
			err = d.recheck(ctx, w)
			if ctx.Err() != nil {
				return
			}
		}
		if err == nil {
			err = d.fill(ctx, w, r)
		}
		if err == nil {
			// Only a call made after w failed shows that it answers
			// again: one already in flight then (the chunk a draining
			// daemon finishes while it refuses new calls) does not, and w
			// stays failing.
			if since := down.Load(); since != 0 && since < called && down.CompareAndSwap(since, 0) {
				d.setUp(w, +1)
				d.say("fill: teacher %s answers again (it failed for %s)", w.Name(), roundDuration(time.Since(time.Unix(0, since))))
			}
			backoff = 200 * time.Millisecond
			if d.remaining.Add(-1) == 0 {
				d.cancel()
			}
			continue
		}
		if ctx.Err() == nil && isBusy(w, err) {
			d.busy(r, err)
			continue
		}
		if ctx.Err() != nil || !d.retry(w, r, err, down) {
			return
		}
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// fill asks w for chunk r under a stall watchdog (StallTimeout): every
// message, the chunk's report or progress, feeds it; when it fires, the
// call is cancelled and its error is a *stall.Error (Unavailable), which
// work treats as a teacher that failed, after stalled has said so.
func (d *fillDispatch) fill(ctx context.Context, w Worker, r cache.Range) error {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var clk stall.Clock
	if d.p.stallClock != nil {
		clk = d.p.stallClock(w)
	}
	wd := stall.Start(d.p.StallTimeout, clk, nil, func(time.Duration) { cancel() })
	err := w.Fill(cctx, d.p.request(d.fp, r), func(m *pb.FillResponse) error {
		wd.Alive()
		if p := m.GetProgress(); p != nil {
			if d.p.onProgress != nil {
				d.p.onProgress(w, p)
			}
			return nil
		}
		d.report(w, m)
		return nil
	})
	if waited, stalled := wd.Stop(); stalled && err != nil && ctx.Err() == nil {
		se := &stall.Error{Addr: w.Name(), What: fmt.Sprintf("chunk [%d, %d)", r.Start, r.End), Waited: waited, Flag: "--stall-timeout"}
		d.stalled(ctx, w, se)
		return se
	}
	return err
}

// stalled says that w stalled on a chunk (one line: the teacher, the
// chunk, the wait, the flag) and keeps w's Status now, for recheck to
// tell when it works again.
func (d *fillDispatch) stalled(ctx context.Context, w Worker, se *stall.Error) {
	d.say("fill: %s; its chunk goes back to the queue for the other teachers, and it gets chunks again only once a forward pass completes on it (or it is restarted) within --retry-for", se)
	cctx, cancel := context.WithTimeout(ctx, askTimeout)
	st, err := w.Status(cctx, &pb.StatusRequest{})
	cancel()
	if err != nil {
		return // not answering at all now: a failing teacher as any other
	}
	d.mu.Lock()
	d.stallAt[w.Name()] = st
	d.mu.Unlock()
}

// isStall reports whether err is a call a stall watchdog cancelled.
func isStall(err error) bool {
	var se *stall.Error
	return errors.As(err, &se)
}

// join waits for w, which did not answer when the fill started, to
// answer as the first teacher did (ask), checks it against that one, and
// adds its cache directory; false if it did not answer by RetryFor after
// the start (said), the fill ended first, or it refused (the fill is
// aborted, as a refusal at the start fails it).
func (d *fillDispatch) join(ctx context.Context, w Worker) bool {
	for {
		a, wait, err := d.p.ask(ctx, w)
		if ctx.Err() != nil {
			return false
		}
		if err != nil {
			d.abort(err)
			return false
		}
		var st *pb.StatusResponse
		if wait == nil {
			if err := disagree(d.ref, d.refAnswer, w, &a); err != nil {
				d.abort(err)
				return false
			}
			cctx, cancel := context.WithTimeout(ctx, askTimeout)
			st, err = w.Status(cctx, &pb.StatusRequest{DatasetFingerprint: d.fp})
			cancel()
			switch {
			case ctx.Err() != nil:
				return false
			case err != nil && waitable(w, err):
				wait = &askError{"cache status", err}
			case err != nil:
				d.abort(fillErr("%s", failure(w, "cache status", err)))
				return false
			}
		}
		if wait == nil {
			d.mu.Lock()
			key := d.dirs.add(w, a.info.GetCacheDir(), d.sum)
			for _, r := range st.GetDone() {
				d.dirs.byDir[key] = append(d.dirs.byDir[key], cache.Range{Start: r.GetStart(), End: r.GetEnd()})
			}
			d.mu.Unlock()
			d.setUp(w, +1)
			d.say("fill: teacher %s answers (after %s): it joins the fill", w.Name(), roundDuration(d.now().Sub(d.start)))
			return true
		}
		d.mu.Lock()
		d.lastErr[w.Name()] = fmt.Sprintf("%s: %s", status.Code(wait.(*askError).err), wait)
		d.mu.Unlock()
		if d.now().Sub(d.start) >= d.p.RetryFor {
			d.say("fill: teacher %s has not answered in %s (--retry-for): the fill goes on without it (%s)", w.Name(), d.p.RetryFor, wait)
			return false
		}
		select {
		case <-d.p.timeAfter(loadingPoll):
		case <-ctx.Done():
			return false
		}
	}
}

// recheck asks w, which failed and may have been restarted since, what
// it runs and where it writes, before it gets a chunk again. Its error is
// a call that failed (w stays failing, and the caller retries it, as a
// failed Fill); a teacher that answers another checkpoint, vocabulary,
// tokenizer or dataset than the fill's aborts the fill (the error is then
// the cancelled context's). A teacher restarted on another cache directory
// writes there from now on: its directory is added, to be read with the
// others (the chunks it reported stay in the one it wrote before).
func (d *fillDispatch) recheck(ctx context.Context, w Worker) error {
	if err := d.unstalled(ctx, w); err != nil {
		return err
	}
	a, wait, err := d.p.ask(ctx, w)
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case err != nil:
		d.abort(err)
		return ctx.Err()
	case wait != nil:
		return wait.(*askError).err
	}
	if name, was, now := differ(d.refAnswer, &a); name != "" {
		d.abort(fillErr("teacher %s came back with another %s (%v, where the fill's teachers have %v): restart it as it was (the same checkpoint, tokenizer and dataset files), or fill another cache with it",
			w.Name(), name, now, was))
		return ctx.Err()
	}
	dir := a.info.GetCacheDir()
	d.mu.Lock()
	before := d.dirs.pathOf[d.dirs.of[w]]
	moved := dir != before
	if moved {
		d.dirs.moved[d.dirs.of[w]] = dir
		d.dirs.add(w, dir, d.sum)
	}
	d.mu.Unlock()
	if !moved {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, askTimeout)
	st, err := w.Status(cctx, &pb.StatusRequest{DatasetFingerprint: d.fp})
	cancel()
	if err != nil {
		return err
	}
	d.mu.Lock()
	key := d.dirs.of[w]
	d.dirs.byDir[key] = d.dirs.byDir[key][:0]
	for _, r := range st.GetDone() {
		d.dirs.byDir[key] = append(d.dirs.byDir[key], cache.Range{Start: r.GetStart(), End: r.GetEnd()})
	}
	d.mu.Unlock()
	d.say("fill: teacher %s writes %s now (it wrote %s): it was restarted with another --cache; the fill goes on there, and the directories are read together", w.Name(), dir, before)
	return nil
}

// unstalled checks that w, if it stalled, has completed a forward pass
// since or was restarted (stall.Recheck); its error keeps w failing.
func (d *fillDispatch) unstalled(ctx context.Context, w Worker) error {
	d.mu.Lock()
	at := d.stallAt[w.Name()]
	d.mu.Unlock()
	if at == nil {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, askTimeout)
	defer cancel()
	ask := func(ctx context.Context) (*pb.StatusResponse, error) { return w.Status(ctx, &pb.StatusRequest{}) }
	if err := stall.Recheck(cctx, ask, at, "--stall-timeout", d.p.StallTimeout); err != nil {
		return err
	}
	d.mu.Lock()
	delete(d.stallAt, w.Name())
	d.mu.Unlock()
	return nil
}

// setUp counts w as answering again (+1) or failing (-1); when none
// answers, the progress says since when it waits (waiting). The wait
// ends when a teacher counts as answering again, which is when its first
// chunk since it failed is done: the time the progress showed as waiting
// is the time left out of the rate.
func (d *fillDispatch) setUp(w Worker, delta int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	was := d.up
	d.up += delta
	switch {
	case d.up == 0:
		d.waitSince = d.now()
	case was <= 0 && d.up > 0 && !d.waitSince.IsZero():
		d.waited += d.now().Sub(d.waitSince)
	}
}

// waiting reports whether no teacher answers, since when, and how long
// the waits that have ended took in all.
func (d *fillDispatch) waiting() (since time.Time, now bool, waited time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.waitSince, d.up <= 0, d.waited
}

// roundDuration rounds d to the second, or under a second to the
// millisecond (not "0s").
func roundDuration(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(time.Second)
}

// report counts a chunk w reported. A chunk reported and then redone (its
// Fill failed after the report, and the chunk went back to the queue) is
// in the caches twice but counts once.
func (d *fillDispatch) report(w Worker, m *pb.FillResponse) {
	if m.GetSkipped() {
		d.mu.Lock()
		if _, ok := d.busyAt[cache.Range{Start: m.GetStart(), End: m.GetEnd()}]; ok {
			d.sum.ByOthers++
		}
		d.mu.Unlock()
	}
	if !m.GetSkipped() {
		cr := cache.Range{Start: m.GetStart(), End: m.GetEnd()}
		d.mu.Lock()
		d.dirs.byDir[d.dirs.of[w]] = append(d.dirs.byDir[d.dirs.of[w]], cr)
		first := !d.counted[cr]
		d.counted[cr] = true
		if first {
			d.sum.addCounts(m)
		}
		d.mu.Unlock()
		if first {
			d.samples.Add(m.GetEnd() - m.GetStart())
			d.tokens.Add(m.GetTokens())
			d.chunks.Add(1)
		}
	}
	if d.p.onChunk != nil {
		d.p.onChunk(w, m)
	}
}

// retry puts chunk r, whose Fill on w failed with err, back in the queue,
// and reports whether w goes on: not when the error is permanent or the
// chunk failed too often (both abort the fill), nor when w has been
// failing for longer than RetryFor.
func (d *fillDispatch) retry(w Worker, r cache.Range, err error, down *atomic.Int64) bool {
	if permanent(w, err) {
		what := fmt.Sprintf("chunk [%d, %d)", r.Start, r.End)
		if isLocal(w) { // the core's own error, wrapped: its kind stays visible (errors.Is)
			d.abort(fillErr("%s: %w", what, err))
			return false
		}
		d.abort(fillErr("%s", failure(w, what, err)))
		return false
	}
	// The teacher is unhealthy (dead, restarting, overloaded): the chunk
	// goes back for anyone, this worker backs off.
	d.mu.Lock()
	// A teacher that is down (Unavailable) or busy says nothing about the
	// chunk; other errors count against it.
	if c := status.Code(err); c != codes.Unavailable && c != codes.ResourceExhausted {
		d.failures[r]++
	}
	nf := d.failures[r]
	d.lastErr[w.Name()] = fmt.Sprintf("%s: %s", status.Code(err), msg(err))
	d.mu.Unlock()
	d.retries.Add(1)
	d.queue <- r
	if nf >= d.p.MaxChunkFailures {
		d.abort(fillErr("chunk [%d, %d) failed %d times, last on teacher %s: %s", r.Start, r.End, nf, w.Name(), msg(err)))
		return false
	}
	if d.p.RetryFor < 0 {
		d.setUp(w, -1)
		if isStall(err) {
			return false // said by stalled
		}
		d.say("fill: teacher %s failed (%s: %s): its chunks go back to the queue, for the other teachers if any (--retry-for 0: it is not retried)", w.Name(), status.Code(err), msg(err))
		return false
	}
	now := time.Now().UnixNano()
	if down.CompareAndSwap(0, now) {
		d.setUp(w, -1)
		// Said as it happens: the progress may stall while it is retried.
		// A stall was said by stalled, with its chunk.
		if !isStall(err) {
			d.say("fill: teacher %s failed (%s: %s): its chunks go back to the queue; retrying it for up to %s (--retry-for)", w.Name(), status.Code(err), msg(err), d.p.RetryFor)
		}
	}
	// Past RetryFor, give up on this teacher; the others carry on.
	if time.Duration(now-down.Load()) <= d.p.RetryFor {
		return true
	}
	d.mu.Lock()
	first := !d.gaveUp[w.Name()]
	d.gaveUp[w.Name()] = true
	d.mu.Unlock()
	if first {
		d.say("fill: teacher %s has failed for longer than %s (--retry-for): giving up on it; the other teachers, if any, take its chunks", w.Name(), d.p.RetryFor)
	}
	return false
}

// isBusy reports whether w's Fill failed only because another writer of
// the cache is computing (part of) the chunk: cache.ErrRangeBusy
// in-process, Aborted from a daemon.
func isBusy(w Worker, err error) bool {
	if isLocal(w) {
		return errors.Is(err, cache.ErrRangeBusy)
	}
	return status.Code(err) == codes.Aborted
}

// busy puts chunk r, which another writer is computing, at the back of
// the queue, to be asked for again BusyPoll from now: the worker goes on
// with other chunks, and the chunk is neither a failure nor a retry. The
// first time, it is said, and again every BusyRepeat while it stays busy.
func (d *fillDispatch) busy(r cache.Range, err error) {
	now := d.now()
	d.mu.Lock()
	d.busyAt[r] = now
	last, said := d.busySaid[r]
	repeat := said && now.Sub(last) >= d.p.BusyRepeat
	if !said || repeat {
		d.busySaid[r] = now
	}
	d.mu.Unlock()
	switch {
	case !said:
		d.say("fill: chunk [%d, %d) is being computed by another writer of the cache (%s); this fill does its other chunks first, then comes back to it every %s until it is committed, or free to compute here",
			r.Start, r.End, busyHolder(err), d.p.BusyPoll)
	case repeat:
		d.say("fill: still waiting for chunk [%d, %d), which another writer of the cache is computing (%s)", r.Start, r.End, busyHolder(err))
	}
	d.queue <- r
}

// busyHolder is what a busy error says of the writer holding the chunk.
func busyHolder(err error) string {
	m := msg(err)
	if i := strings.Index(m, "(pid "); i >= 0 {
		if j := strings.Index(m[i:], ")"); j > 0 {
			return m[i+1 : i+j]
		}
	}
	return m
}

// waitBusy waits until chunk r, if it was found busy, may be asked for
// again; false if ctx ended first.
func (d *fillDispatch) waitBusy(ctx context.Context, r cache.Range) bool {
	d.mu.Lock()
	at, ok := d.busyAt[r]
	d.mu.Unlock()
	if !ok {
		return true
	}
	wait := time.Until(at.Add(d.p.BusyPoll))
	if wait <= 0 {
		return true
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// say writes one line of the fill's events (a teacher failing, coming
// back, given up on) to the plan's output, over the progress bar on a
// terminal.
func (d *fillDispatch) say(format string, args ...any) {
	if d.p.Out == nil {
		return
	}
	line := fmt.Sprintf(format, args...)
	if d.p.Terminal {
		line = fmt.Sprintf("\r%-100s", line)
	}
	fmt.Fprintln(d.p.Out, line)
}

// abort ends the fill with err (the first one wins).
func (d *fillDispatch) abort(err error) {
	d.mu.Lock()
	if d.fatal == nil {
		d.fatal = err
	}
	d.mu.Unlock()
	d.cancel()
}

// result is the error of a finished run, nil when every chunk was done.
func (d *fillDispatch) result(ctx context.Context) error {
	if d.fatal != nil {
		return d.fatal
	}
	left := d.remaining.Load()
	if left == 0 {
		return nil
	}
	if ctx.Err() != nil {
		// Not our cancel (that comes only with nothing left or with
		// fatal set): the caller's context ended (Ctrl-C, deadline).
		return fillErr("interrupted (%w) with %d chunks left undone; re-run the same command to resume", context.Cause(ctx), left)
	}
	var why []string
	for k, v := range d.lastErr {
		why = append(why, k+": "+v)
	}
	sort.Strings(why)
	return fillErr("%d chunks left undone: no teacher could take them (%s); re-run the same command to resume", left, strings.Join(why, "; "))
}

// addCounts adds a computed chunk's sample counts (caller holds the lock).
func (s *FillSummary) addCounts(m *pb.FillResponse) {
	s.Targets += m.GetTargets()
	s.Truncated += m.GetTruncated()
	s.Dropped += m.GetDropped()
	s.BadSkipped += m.GetBadSkipped()
	for r, n := range m.GetReasons() {
		s.Reasons[r] += n
	}
	for i, e := range m.GetExamples() {
		s.examples = append(s.examples, fillExample{m.GetStart(), i, e})
	}
	sort.Slice(s.examples, func(i, j int) bool {
		a, b := s.examples[i], s.examples[j]
		return a.start < b.start || a.start == b.start && a.i < b.i
	})
	if len(s.examples) > maxFillExamples {
		s.examples = s.examples[:maxFillExamples]
	}
	s.Examples = s.Examples[:0]
	for _, e := range s.examples {
		s.Examples = append(s.Examples, e.msg)
	}
}

// fillExample is one drop or skip message of the chunk starting at start.
type fillExample struct {
	start int64
	i     int
	msg   string
}

// maxFillExamples is how many drop or skip messages a fill prints.
const maxFillExamples = 5

// countsLine says what became of the samples that are not whole.
func (s *FillSummary) countsLine() string {
	return fmt.Sprintf("%d truncated to --max-len, %d dropped, %d bad records skipped", s.Truncated, s.Dropped, s.BadSkipped)
}

// printCounts writes the truncated, dropped and skipped counts, the
// reasons and a few examples, when there are any.
func (s *FillSummary) printCounts(w io.Writer) {
	if s.Truncated == 0 && s.Dropped == 0 && s.BadSkipped == 0 {
		return
	}
	fmt.Fprintf(w, "fill: %s\n", s.countsLine())
	rs := make([]string, 0, len(s.Reasons))
	for r := range s.Reasons {
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool {
		if s.Reasons[rs[i]] != s.Reasons[rs[j]] {
			return s.Reasons[rs[i]] > s.Reasons[rs[j]]
		}
		return rs[i] < rs[j]
	})
	for _, r := range rs {
		fmt.Fprintf(w, "  %6d  %s\n", s.Reasons[r], r)
	}
	for _, e := range s.Examples {
		fmt.Fprintf(w, "  e.g. %s\n", e)
	}
}

// dirRanges asks each teacher (one per distinct dirOf key) for the
// committed ranges of dataset fp in its cache directory. With lenient, an unreachable teacher is
// left out (the caller keeps what it knew) instead of failing.
func dirRanges(ctx context.Context, workers []Worker, dirOf map[Worker]string, fp string, lenient bool) (map[string][]cache.Range, error) {
	out := map[string][]cache.Range{}
	for _, w := range workers {
		d, ok := dirOf[w]
		if !ok { // a teacher that never joined the fill
			continue
		}
		if _, ok := out[d]; ok {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		st, err := w.Status(cctx, &pb.StatusRequest{DatasetFingerprint: fp})
		cancel()
		if err != nil {
			if lenient {
				continue
			}
			return nil, fillErr("%s", failure(w, "cache status", err))
		}
		rs := []cache.Range{}
		for _, r := range st.GetDone() {
			rs = append(rs, cache.Range{Start: r.GetStart(), End: r.GetEnd()})
		}
		out[d] = rs
	}
	return out, nil
}

// combine merges the ranges of all directories into one sorted list. The
// same range in two directories is the one window of RunFill (a teacher
// committed a chunk and died before reporting it, and another redid it):
// both copies are whole chunks of the same teacher, and readers of the
// directories as one cache use one of them, so it is returned in dups, not
// failed. Ranges that overlap without being equal (directories filled with
// different chunk boundaries) are an error: no reader can use them together.
// Keys with the same pathOf are one directory seen by two teachers on one
// machine (or the same path on two machines, which cannot be told apart):
// their identical ranges are merged without a report.
func combine(byDir map[string][]cache.Range, pathOf map[string]string) (done []cache.Range, dups []string, err error) {
	type owned struct {
		cache.Range
		dir string
	}
	var all []owned
	for d, rs := range byDir {
		for _, r := range rs {
			all = append(all, owned{r, d})
		}
	}
	sort.Slice(all, func(i, j int) bool {
		if all[i].Start != all[j].Start {
			return all[i].Start < all[j].Start
		}
		return all[i].dir < all[j].dir
	})
	var prev owned
	for i, r := range all {
		if i > 0 && r.Start < prev.End {
			if r.Range == prev.Range {
				if p, ok := pathOf[r.dir]; ok && p == pathOf[prev.dir] {
					continue
				}
				dups = append(dups, fmt.Sprintf("%v in %s and %s", r.Range, prev.dir, r.dir))
				continue
			}
			return nil, nil, fillErr("samples %v are in two cache directories (%s and %s) with different chunk boundaries: fill them with the same --chunk, or keep one directory",
				cache.Range{Start: r.Start, End: min(r.End, prev.End)}, prev.dir, r.dir)
		}
		done = append(done, r.Range)
		prev = r
	}
	return done, dups, nil
}

// startProgress draws a bar on a terminal or logs a line every LogEvery;
// the returned func stops it and finishes the line. While waiting (nil:
// never) reports that no teacher answers, the line says since when the
// fill waits for them instead of a rate that only decays. The rate and
// the ETA count the time since t0 less the waits that have ended: a
// fill that waited an hour for its teachers would otherwise report a
// rate far below the one they compute at, and an ETA far too long,
// until the end of the run.
func startProgress(p *FillPlan, total, already int64, samples, tokens *atomic.Int64, t0 time.Time, waiting func() (since time.Time, now bool, waited time.Duration)) func() {
	if p.Out == nil {
		return func() {}
	}
	every := p.LogEvery
	if p.Terminal {
		every = 500 * time.Millisecond
	}
	stop, done := make(chan struct{}), make(chan struct{})
	line := func() string {
		now := p.timeNow()
		work := now.Sub(t0)
		if waiting != nil {
			since, ok, waited := waiting()
			if ok {
				return waitingLine(p.Terminal, total, already, samples.Load(), since, now)
			}
			work -= waited
		}
		return progressLine(p.Terminal, total, already, samples.Load(), tokens.Load(), work.Seconds())
	}
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				fmt.Fprint(p.Out, line())
			case <-stop:
				if p.Terminal {
					fmt.Fprint(p.Out, line()+"\n")
				}
				return
			}
		}
	}()
	return func() { close(stop); <-done }
}

// progressLine is one progress report: done of total samples (already
// done before this run, plus s computed in it), tok tokens in el seconds
// of work (no waits for the teachers in it).
// The counts are clamped to [0, total]: a chunk counted twice (a teacher
// that reported it and failed, then another redid it) or a range already
// done that reaches past the fill's would otherwise draw more than a full
// bar, and strings.Repeat panics on the negative rest.
func progressLine(terminal bool, total, already, s, tok int64, el float64) string {
	doneN := min(max(already+s, 0), total)
	rate := float64(tok) / max(el, 1e-9)
	eta := "?"
	if s > 0 {
		eta = (time.Duration(float64(total-doneN) * el / float64(s) * float64(time.Second))).Round(time.Second).String()
	}
	frac := 1.0
	if total > 0 {
		frac = float64(doneN) / float64(total)
	}
	if terminal {
		const w = 30
		n := min(max(int(frac*w), 0), w)
		bar := strings.Repeat("=", n) + strings.Repeat(" ", w-n)
		return fmt.Sprintf("\r[%s] %d/%d samples %5.1f%%  %.0f tokens/s  ETA %s   ", bar, doneN, total, 100*frac, rate, eta)
	}
	return fmt.Sprintf("fill: %d/%d samples (%.1f%%), %.0f tokens/s, ETA %s\n", doneN, total, 100*frac, rate, eta)
}

// waitingLine is the progress while no teacher answers: done of total
// samples (as progressLine counts them), and since when the fill waits.
func waitingLine(terminal bool, total, already, s int64, since, now time.Time) string {
	doneN := min(max(already+s, 0), total)
	frac := 1.0
	if total > 0 {
		frac = float64(doneN) / float64(total)
	}
	wait := fmt.Sprintf("waiting for the teachers since %s (%s): none answers", since.Format("15:04:05"), roundDuration(now.Sub(since)))
	if terminal {
		const w = 30
		n := min(max(int(frac*w), 0), w)
		bar := strings.Repeat("=", n) + strings.Repeat(" ", w-n)
		return fmt.Sprintf("\r[%s] %d/%d samples %5.1f%%  %s   ", bar, doneN, total, 100*frac, wait)
	}
	return fmt.Sprintf("fill: %d/%d samples (%.1f%%), %s\n", doneN, total, 100*frac, wait)
}

// optK is FillPlan.K as the request field: 0 (the teacher's default) is
// absent.
func optK(k int32) *int32 {
	if k == 0 {
		return nil
	}
	return &k
}
