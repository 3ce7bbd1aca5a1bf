package compute

import "fmt"

// WorkerPanic is what a kernel's caller panics with when one of the
// kernel's worker goroutines panicked. A panic in a goroutine that nothing
// recovers ends the process, and the caller's own recover (the daemon's
// forward pass) cannot reach into the workers; so a backend's workers
// recover, and the kernel panics again with this value on the goroutine
// that called it, where a recover does catch it.
type WorkerPanic struct {
	// Value is what the worker panicked with.
	Value any
	// Stack is the worker's stack at the panic.
	Stack []byte
}

func (p *WorkerPanic) Error() string {
	return fmt.Sprintf("compute: kernel worker goroutine panicked: %v", p.Value)
}

// Unwrap returns the worker's panic value when it is an error (a runtime
// error such as an index out of range), so errors.As finds it.
func (p *WorkerPanic) Unwrap() error {
	err, _ := p.Value.(error)
	return err
}
