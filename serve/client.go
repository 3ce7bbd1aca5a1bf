package serve

import (
	"context"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// Worker is one teacher a fill drives: a daemon over gRPC (Dial) or a Core
// in this process (Local). Errors are gRPC status errors either way, so
// the driver classifies them the same.
type Worker interface {
	// Name identifies the worker in messages (its address, or "in-process").
	Name() string
	Info(ctx context.Context) (*pb.InfoResponse, error)
	Describe(ctx context.Context, d *pb.Dataset) (*pb.DescribeDatasetResponse, error)
	Status(ctx context.Context, r *pb.StatusRequest) (*pb.StatusResponse, error)
	// Fill calls onChunk with every message of the fill: the chunks'
	// reports and, when r asks for them, progress messages (progress
	// set, no other field).
	Fill(ctx context.Context, r *pb.FillRequest, onChunk func(*pb.FillResponse) error) error
	Close() error
}

// DialOptions configure Dial (package teacherdial's options).
type DialOptions = teacherdial.Options

// remote is a Worker over a gRPC connection.
type remote struct {
	addr string
	conn *grpc.ClientConn
	c    pb.TeacherClient
}

// Dial returns a Worker for the daemon at addr. The connection is lazy:
// errors show up on the first call. An error is package teacherdial's,
// naming the option as o.Names does.
func Dial(addr string, o DialOptions) (Worker, error) {
	conn, err := teacherdial.Dial(addr, o)
	if err != nil {
		return nil, err
	}
	return &remote{addr: addr, conn: conn, c: pb.NewTeacherClient(conn)}, nil
}

func (r *remote) Name() string { return r.addr }
func (r *remote) Info(ctx context.Context) (*pb.InfoResponse, error) {
	return r.c.Info(ctx, &pb.InfoRequest{})
}
func (r *remote) Describe(ctx context.Context, d *pb.Dataset) (*pb.DescribeDatasetResponse, error) {
	return r.c.DescribeDataset(ctx, &pb.DescribeDatasetRequest{Dataset: d})
}
func (r *remote) Status(ctx context.Context, q *pb.StatusRequest) (*pb.StatusResponse, error) {
	return r.c.Status(ctx, q)
}
func (r *remote) Fill(ctx context.Context, q *pb.FillRequest, on func(*pb.FillResponse) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := r.c.Fill(ctx, q)
	if err != nil {
		return err
	}
	for {
		m, err := st.Recv()
		if err != nil {
			if isEOF(err) {
				return nil
			}
			return err
		}
		if err := on(m); err != nil {
			return err
		}
	}
}
func (r *remote) Close() error { return r.conn.Close() }

// local is a Worker over a Core in this process.
type local struct {
	c *Core
}

// Local returns a Worker over c (`cachectl fill --model`); Close closes c.
// Its errors carry the gRPC code a daemon would answer with, so that the
// driver classifies them alike, but their full text: the user is the
// operator, and there is no daemon log to point to.
func Local(c *Core) Worker { return &local{c: c} }

func (l *local) Name() string                                       { return "in-process" }
func (l *local) Info(ctx context.Context) (*pb.InfoResponse, error) { return l.c.Info(), nil }
func (l *local) Describe(ctx context.Context, d *pb.Dataset) (*pb.DescribeDatasetResponse, error) {
	r, err := l.c.DescribeDataset(d)
	return r, localStatus(err)
}
func (l *local) Status(ctx context.Context, q *pb.StatusRequest) (*pb.StatusResponse, error) {
	r, err := l.c.Status(q)
	return r, localStatus(err)
}
func (l *local) Fill(ctx context.Context, q *pb.FillRequest, on func(*pb.FillResponse) error) error {
	return localStatus(l.c.Fill(ctx, q, on))
}
func (l *local) Close() error { return l.c.Close() }

// localStatus is err as a status with toStatus's code and err's own text
// (toStatus keeps internal detail from a daemon's clients), still
// wrapping err: in-process callers can tell its kind (errors.Is, e.g. a
// bad record of package data).
func localStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return &localError{st: status.New(status.Code(toStatus(zap.NewNop(), err)), err.Error()), err: err}
}

// localError is an in-process core's error as a gRPC status (GRPCStatus)
// that unwraps to the error itself.
type localError struct {
	st  *status.Status
	err error
}

func (e *localError) Error() string              { return e.err.Error() }
func (e *localError) GRPCStatus() *status.Status { return e.st }
func (e *localError) Unwrap() error              { return e.err }

// say picks a message's wording: for a daemon's clients, or for the user
// of an in-process core (CoreOptions.InProcess), who started no daemon.
func (c *Core) say(daemon, inProcess string) string {
	if c.opt.InProcess {
		return inProcess
	}
	return daemon
}
