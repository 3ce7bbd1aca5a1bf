package cuda

import (
	"fmt"
	"math"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"
)

// Host waits. Everything is issued on one stream, so the GPU runs as far
// ahead of the host as the host has issued; a call that makes the host
// wait for the stream (a download, a synchronization) lets the GPU drain,
// and the GPU then idles until the host has issued enough new work. A
// training step's idle time between kernels (ProfileSpan minus the
// kernels' sum) is mostly that. CountHostWaits counts them by kind and
// call site, for the tests that hold a training step to its count and
// for the benchmarks that print it beside the idle time.

// Kinds of host wait.
const (
	// WaitDownload is a copy to pageable host memory (ReadF32, ReadI32, a
	// loss's values, a norm): the host waits for everything issued.
	WaitDownload = "download"
	// WaitSync is a synchronization without a copy (cuStreamSynchronize:
	// MemInfo, PeakMemory, the profile's events, NCCL's error check).
	WaitSync = "sync"
	// WaitUpload is a copy from pageable host memory (cuMemcpyHtoDAsync
	// from Go memory): CUDA stages it through pinned memory and may wait
	// for the stream to do so, so it counts as a potential wait. Uploads
	// from the pinned staging ring (staging.go) are not counted: they
	// never wait.
	WaitUpload = "pageable-upload"
	// WaitEvent is the host waiting for an event (cuEventSynchronize)
	// that it has not synchronized past: the staging ring reusing a
	// quarter whose copies may still run, a loss's values read before
	// the step's synchronization. It waits for a point in the middle of
	// the stream, not for its end: the GPU keeps the work queued after it.
	// Counted whether or not the event is done when asked (the count is
	// the same on the emulator and on a GPU).
	WaitEvent = "event"
)

// HostWait is the count of one kind of host wait at one call site.
type HostWait struct {
	// Kind is WaitDownload, WaitSync, WaitUpload or WaitEvent.
	Kind string
	// Site is the backend's method and its caller outside this package,
	// e.g. "ReadF32 <- decoder.(*Model).Routing (train.go:600)".
	Site  string
	Count int
}

func (w HostWait) String() string { return fmt.Sprintf("%5d %-16s %s", w.Count, w.Kind, w.Site) }

// hostWaits counts host waits while CountHostWaits is on (nil: off, and
// counting costs one nil check).
type hostWaits map[[2]string]int

// CountHostWaits starts (on) or stops counting host waits, clearing the
// counts either way.
func (b *Backend) CountHostWaits(on bool) {
	defer b.enter()()
	b.waits = nil
	if on {
		b.waits = hostWaits{}
	}
}

// HostWaits returns the host waits counted since CountHostWaits(true) or
// the last HostWaits (which clears them), the most frequent first.
func (b *Backend) HostWaits() []HostWait {
	defer b.enter()()
	var out []HostWait
	for k, n := range b.waits {
		out = append(out, HostWait{Kind: k[0], Site: k[1], Count: n})
	}
	if b.waits != nil {
		b.waits = hostWaits{}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Count != out[j].Count {
			return out[i].Count > out[j].Count
		}
		if out[i].Kind != out[j].Kind {
			return out[i].Kind < out[j].Kind
		}
		return out[i].Site < out[j].Site
	})
	return out
}

// waited counts one host wait of kind at the caller's site, when
// counting is on.
func (b *Backend) waited(kind string) {
	if b.waits == nil {
		return
	}
	b.waits[[2]string{kind, waitSite()}]++
}

// waitSite names the call site of a host wait: the outermost function of
// this package on the stack (the backend's method the caller called) and
// the first caller outside it, or outside package compute, whose generic
// helpers (compute.ClipGradNorm's kind) say less than their callers.
func waitSite() string {
	pc := make([]uintptr, 32)
	n := runtime.Callers(3, pc)
	frames := runtime.CallersFrames(pc[:n])
	const self, contract = "distill/compute/cuda.", "distill/compute."
	method, site := "", ""
	for {
		f, more := frames.Next()
		switch {
		case strings.HasPrefix(f.Function, self):
			method = strings.TrimPrefix(f.Function, self)
		case strings.HasPrefix(f.Function, contract) && site == "":
			site = short(f) // a helper of the contract: name its caller too
		default:
			if site != "" {
				return method + " <- " + site + " <- " + short(f)
			}
			return method + " <- " + short(f)
		}
		if !more {
			return method + " <- " + site
		}
	}
}

// short is a frame as "pkg.Func (file.go:line)", the package's last path
// element only.
func short(f runtime.Frame) string {
	fn := f.Function
	if i := strings.LastIndex(fn, "/"); i >= 0 {
		fn = fn[i+1:]
	}
	return fmt.Sprintf("%s (%s:%d)", fn, filepath.Base(f.File), f.Line)
}

// HostTimeline is the host's side of a profiled stretch of work (from
// SetProfile(true)), on the host's clock: when the backend was first and
// last called, when it first issued timed work (a kernel, GEMM, cuDNN call
// or device copy: where ProfileSpan begins on the GPU), and how long the
// host waited for the device. A benchmark that also notes when its pass
// began and returned can tell what the GPU's span leaves out: the host's
// work before the first launch (the GPU has nothing to do) and after the
// last wait (the GPU has finished).
type HostTimeline struct {
	First, Last, FirstLaunch time.Time
	Waits                    int           // the host waits (HostWait's kinds)
	Waited                   time.Duration // their time
	LastWaitEnd              time.Time
}

// HostTimeline returns the host timeline since SetProfile(true) (the zero
// value when profiling is off). It does not count as a call.
func (b *Backend) HostTimeline() HostTimeline {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.tl
}

// noteCall records a backend call in the timeline (caller holds b.mu).
func (b *Backend) noteCall() {
	if b.prof == nil {
		return
	}
	now := time.Now()
	if b.tl.First.IsZero() {
		b.tl.First = now
	}
	b.tl.Last = now
}

// noteWait records a host wait that began at t0 in the timeline.
func (b *Backend) noteWait(t0 time.Time) {
	if b.prof == nil {
		return
	}
	now := time.Now()
	b.tl.Waits++
	b.tl.Waited += now.Sub(t0)
	b.tl.LastWaitEnd = now
}

// Describe says where a profiled pass's host time went, what being the
// pass's name, p0 and p1 when it began and returned: before the first
// launch the GPU had nothing to do, and after the last host wait it had
// finished (a benchmark's pass minus its GPU span is mostly those two).
func (tl HostTimeline) Describe(what string, p0, p1 time.Time) string {
	ms := func(t time.Time) float64 {
		if t.IsZero() {
			return math.NaN()
		}
		return 1e3 * t.Sub(p0).Seconds()
	}
	return fmt.Sprintf("host timeline of the profiled %s (ms from its start): first backend call %.1f, first launch %.1f, last call %.1f, %d host waits for %.1f ms (the last ending at %.1f), returned at %.1f: %.1f ms before the first launch, %.1f ms after the last wait",
		what, ms(tl.First), ms(tl.FirstLaunch), ms(tl.Last), tl.Waits, 1e3*tl.Waited.Seconds(), ms(tl.LastWaitEnd), ms(p1), ms(tl.FirstLaunch), ms(p1)-ms(tl.LastWaitEnd))
}
