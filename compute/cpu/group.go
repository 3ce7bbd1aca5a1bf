package cpu

import (
	"fmt"
	"runtime/debug"
	"sync"
)

// WorkerPanic is what a kernel's caller panics with when one of the
// kernel's worker goroutines panicked. A panic in a goroutine that nothing
// recovers ends the process, and the caller's own recover (the daemon's
// forward pass) cannot reach into the workers; so every worker recovers,
// and Wait panics again with this value on the goroutine that started the
// kernel, where a recover does catch it.
type WorkerPanic struct {
	// Value is what the worker panicked with.
	Value any
	// Stack is the worker's stack at the panic.
	Stack []byte
}

func (p *WorkerPanic) Error() string {
	return fmt.Sprintf("cpu: kernel worker goroutine panicked: %v", p.Value)
}

// Unwrap returns the worker's panic value when it is an error (a runtime
// error such as an index out of range), so errors.As finds it.
func (p *WorkerPanic) Unwrap() error {
	err, _ := p.Value.(error)
	return err
}

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
