package api

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/internal/refstore"
	"github.com/redfence/redfence/service"
)

// isHeld matches service.ErrHeld through an Is method.
type isHeld struct{}

func (isHeld) Error() string        { return "is held" }
func (isHeld) Is(target error) bool { return target == service.ErrHeld }

// asStale turns into a *fencing.StaleError through an As method.
type asStale struct{}

func (asStale) Error() string { return "as stale" }
func (asStale) As(target any) bool {
	if p, ok := target.(**fencing.StaleError); ok {
		*p = &fencing.StaleError{Key: "t/k", Got: 1, Current: 2}
		return true
	}
	return false
}

// TestErrTree checks that the flattened error tree answers as errors.Is and
// errors.As do, and so classify as before.
func TestErrTree(t *testing.T) {
	se := &service.Error{Op: "acquire", Key: "k", Err: service.ErrHeld, Cause: fmt.Errorf("node: %w", context.Canceled)}
	wait := &service.Error{Op: "acquire", Key: "k", Err: service.ErrWaitTimeout, Cause: se}
	errs := []error{
		se, wait, fmt.Errorf("wrapped: %w", wait), errors.Join(errors.New("x"), wait, invalid("bad", InvalidParam{Name: "x", Reason: "bad"})),
		fmt.Errorf("%w and %w", &authError{kind: kForbidden}, invalid("bad", InvalidParam{Name: "x", Reason: "bad"})), isHeld{}, fmt.Errorf("w: %w", isHeld{}),
		asStale{}, errors.Join(asStale{}, &fencing.StaleError{Key: "k"}), &service.Error{Op: "release", Err: service.ErrNotHolder},
		&service.InvalidError{Field: "ttl", Reason: "too long"}, fmt.Errorf("x: %w", &service.InvalidError{Field: "wait"}),
		fencing.ErrStale, refstore.ErrNotFound, refstore.ErrUnavailable, context.Canceled, errors.New("other"),
		errors.Join(), errors.Join(nil, se), fmt.Errorf("%w %w %w", errors.Join(se, wait), isHeld{}, asStale{}),
	}
	targets := []error{service.ErrHeld, service.ErrWaitTimeout, service.ErrNotHolder, service.ErrInvalid, context.Canceled,
		fencing.ErrStale, refstore.ErrNotFound, refstore.ErrInvalidData}
	for _, err := range errs {
		var buf [2]error
		tree := flatten(buf[:0], err)
		for _, target := range targets {
			if got, want := tree.is(target), errors.Is(err, target); got != want {
				t.Errorf("is(%v, %v) = %v; errors.Is %v", err, target, got, want)
			}
		}
		checkAs[*requestError](t, err, tree)
		checkAs[*authError](t, err, tree)
		checkAs[*service.Error](t, err, tree)
		checkAs[*service.InvalidError](t, err, tree)
		checkAs[*fencing.StaleError](t, err, tree)
		if got, want := classify(err), oldClassify(err); got != want {
			t.Errorf("classify(%v) = %s; before %s", err, got.slug, want.slug)
		}
	}
}

func checkAs[P interface {
	*T
	error
}, T any](t *testing.T, err error, tree errTree) {
	t.Helper()
	got, ok := asErr[P](tree)
	var want P
	wantOK := errors.As(err, &want)
	if ok != wantOK || (ok && fmt.Sprintf("%#v", got) != fmt.Sprintf("%#v", want)) {
		t.Errorf("asErr[%T](%v) = %v %v; errors.As %v %v", want, err, got, ok, want, wantOK)
	}
}

// oldClassify is classify as it was, with errors.Is and errors.As.
func oldClassify(err error) kind {
	var re *requestError
	var ae *authError
	switch {
	case errors.As(err, &re):
		return re.kind
	case errors.As(err, &ae):
		return ae.kind
	case errors.Is(err, service.ErrInvalid):
		return kInvalid
	case errors.Is(err, service.ErrWaitTimeout) && errors.Is(err, service.ErrHeld):
		return kWaitTimeout
	case errors.Is(err, service.ErrHeld):
		return kHeld
	case errors.Is(err, service.ErrQuorum):
		return kQuorum
	case errors.Is(err, service.ErrFencing):
		return kFencing
	case errors.Is(err, service.ErrExpired):
		return kExpired
	case errors.Is(err, service.ErrLost):
		return kLost
	case errors.Is(err, service.ErrNotHolder):
		return kNotHolder
	case errors.Is(err, fencing.ErrStale):
		return kStale
	case errors.Is(err, refstore.ErrNotFound):
		return kNoResource
	case errors.Is(err, refstore.ErrInvalidData):
		return kInvalid
	case errors.Is(err, refstore.ErrUnavailable):
		return kStore
	case errors.Is(err, context.Canceled):
		return kCancelled
	}
	return kInternal
}

func TestRetryAfterMS(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		d    time.Duration
		want int64
	}{
		{0, 0}, {-time.Second, 0}, {time.Nanosecond, 1}, {999 * time.Microsecond, 1},
		{time.Millisecond, 1}, {time.Millisecond + 1, 2}, {2417 * time.Millisecond, 2417},
	} {
		if got := retryAfterMS(tc.d); got != tc.want {
			t.Errorf("retryAfterMS(%v) = %d; want %d", tc.d, got, tc.want)
		}
	}
}
