package cpu

import (
	"runtime/debug"
	"sync"

	"distill/compute"
)

// WorkerPanic is compute.WorkerPanic, what a kernel's caller panics with
// when one of the kernel's worker goroutines panicked.
type WorkerPanic = compute.WorkerPanic

// group runs worker goroutines and carries the first panic among them to
// the goroutine that waits for them.
type group struct {
	wg    sync.WaitGroup
	mu    sync.Mutex
	panic *WorkerPanic
}

// Go runs fn on a new goroutine.
func (g *group) Go(fn func()) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		defer func() {
			if r := recover(); r != nil {
				g.mu.Lock()
				if g.panic == nil {
					if wp, ok := r.(*WorkerPanic); ok {
						g.panic = wp // a nested kernel's worker: keep its stack
					} else {
						g.panic = &WorkerPanic{Value: r, Stack: debug.Stack()}
					}
				}
				g.mu.Unlock()
			}
		}()
		fn()
	}()
}

// Wait waits for every goroutine, then panics with a *WorkerPanic if one
// of them panicked. The others ran to their end: the kernel's output is
// garbage, but no goroutine is left writing to it.
func (g *group) Wait() {
	g.wg.Wait()
	if g.panic != nil {
		panic(g.panic)
	}
}
